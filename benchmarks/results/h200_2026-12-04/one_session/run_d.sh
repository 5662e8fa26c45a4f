python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
timeout 120 python3 benchmarks/results/h200_2026-12-04/one_session/first_step_garbage.py llama3-8b-4l 2>&1 | grep -v "Warning\|warn" | tail -12
timeout 120 python3 benchmarks/results/h200_2026-12-04/one_session/first_step_garbage.py llama3-8b-4l lk 2>&1 | grep -v "Warning\|warn\|Backend" | tail -6
