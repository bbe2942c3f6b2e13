"""``python -m offload.bench [--demo | --preset NAME] [...]``: the step benchmark (see ``offload.bench.step``)."""

from offload.bench.step import main

if __name__ == "__main__":
    raise SystemExit(main())
