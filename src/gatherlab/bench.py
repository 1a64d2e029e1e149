"""``python -m gatherlab.bench {launcher,gather,sweep,check,record}``: benchmarks, apart from the
tests, each printing ratios measured in one run. The command is `gatherlab.lab.bench`."""

from gatherlab.lab.bench import main

if __name__ == "__main__":
    main()
