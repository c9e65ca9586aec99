"""``pretrain_gpt.py`` whose standbys run with other flags than the job's ranks.

The launcher starts its standbys with the job's own arguments plus ``--tm-role standby``, so a
test that needs a standby of another model shape launches this script instead of
``pretrain_gpt.py``: a process started with ``--tm-role standby`` gets the flags in
``TM_TEST_STANDBY_FLAGS`` (e.g. ``--hidden-size 64``) appended, which override the job's
(argparse keeps the last value); every other process runs ``pretrain_gpt.py`` unchanged.
"""

import os
import runpy
import shlex
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(REPO_ROOT, "pretrain_gpt.py")

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--tm-role" in argv and argv[argv.index("--tm-role") + 1 :][:1] == ["standby"]:
        argv += shlex.split(os.environ.get("TM_TEST_STANDBY_FLAGS", ""))
    sys.argv = [PRETRAIN, *argv]
    runpy.run_path(PRETRAIN, run_name="__main__")
