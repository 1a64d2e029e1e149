"""``python -m gatherlab.audit [--out DIR] [overrides]``: for every gather × loss style × world
size, the gradient the ranks get against one device's. The command is `gatherlab.lab.audit`."""

from gatherlab.lab.audit import main

if __name__ == "__main__":
    main()
