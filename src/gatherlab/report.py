"""Every run of a sweep against its 1-device reference: the comparison table, its text and
figures, the loss matrix and the audit's tables (`gatherlab.analysis.report`, whose public names
this module holds). ``python -m gatherlab.report SWEEP_DIR`` writes a finished sweep's report
again."""

from gatherlab.analysis.report import *  # noqa: F403
from gatherlab.analysis.report import main

if __name__ == "__main__":
    main()
