"""``python -m gatherlab.scaling [--out DIR] [overrides]``: the gradient error as W grows, on real
ranks and in the simulated world, next to its prediction. The command is
`gatherlab.lab.scaling`."""

from gatherlab.lab.scaling import main

if __name__ == "__main__":
    main()
