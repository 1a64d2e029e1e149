"""``python -m gatherlab.train [overrides]`` (``-m`` for a sweep): train the configured runs and,
when a sweep ends, compare each with its 1-device reference. The command is
`gatherlab.lab.train`."""

from gatherlab.lab.train import main

if __name__ == "__main__":
    main()
