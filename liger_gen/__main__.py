"""``python -m liger_gen``: the ``liger-gen`` command line (for an environment whose scripts folder is not on PATH)."""

from liger_gen.cli import main

if __name__ == "__main__":  # pragma: no cover - run by ``python -m liger_gen``
    main()
