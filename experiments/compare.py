"""``python -m experiments.compare A B [--out DIR]``: two runs or sweeps side by side with B/A ratios
(:mod:`experiments.results.compare`)."""
from experiments.results.compare import main

if __name__ == "__main__":
    raise SystemExit(main())
