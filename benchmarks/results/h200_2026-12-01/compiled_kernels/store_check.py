# fresh process, empty Triton cache: the patched model's step must compile nothing (cache dir stays empty)
import os, sys, time, warnings, tempfile
d = tempfile.mkdtemp(); os.environ["TRITON_CACHE_DIR"] = d
warnings.simplefilter("always")
t0 = time.time()
import torch
from liger_gen import prebuild
step = prebuild.model_step(sys.argv[1], 8, 2048, torch.bfloat16, torch.device("cuda"))
t1 = time.time(); step(); torch.cuda.synchronize(); t2 = time.time()
step(); torch.cuda.synchronize(); t3 = time.time()
files = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
print(f"{sys.argv[1]}: first step {t2 - t1:.3f}s, second {t3 - t2:.3f}s; files Triton wrote: {len(files)}", files[:6])
