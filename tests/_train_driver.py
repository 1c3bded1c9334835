"""Runs ``train_toy.py`` as a user would, with test hooks set by environment variables.

Used by tests/test_train_robustness.py, which starts it as a subprocess and signals or kills
it at a chosen moment. The hooks change timing only, never what is computed:

* ``DRIVER_STEP_DELAY=seconds``: each training batch is made that much later (slow steps,
  so a signal surely lands while training runs).
* ``DRIVER_MARK_AT=step:path``: writes ``path`` when the batch of (0-based) update ``step``
  is made, to tell the test that training is under way.
* ``DRIVER_STALL_FINALIZE=step:path``: when orbax is about to finalize checkpoint ``step``
  (its files written to the temporary folder, not yet renamed), writes ``path`` and
  sleeps, so the test can SIGKILL the process in the middle of a save.
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

# As in a terminal: Ctrl-C raises KeyboardInterrupt (a test runner may have ignored SIGINT).
signal.signal(signal.SIGINT, signal.default_int_handler)

delay = float(os.environ.get("DRIVER_STEP_DELAY", "0"))
mark = os.environ.get("DRIVER_MARK_AT")
if delay or mark:
    from jattn.toy import data

    make_batch = data.CopyTask.train_batch
    mark_step, mark_path = mark.split(":", 1) if mark else (None, None)

    def slow_batch(self, step):
        if mark and int(step) == int(mark_step):
            Path(mark_path).write_text("training")
        time.sleep(delay)
        return make_batch(self, step)

    data.CopyTask.train_batch = slow_batch

stall = os.environ.get("DRIVER_STALL_FINALIZE")
if stall:
    import orbax.checkpoint as ocp

    stall_step, stall_path = stall.split(":", 1)
    temporary = ocp.path.atomicity.AtomicRenameTemporaryPath
    finalize = temporary.finalize

    async def stalled_finalize(self, *args, **kwargs):
        if self.get_final().name == stall_step:
            Path(stall_path).write_text(str(self.get()))
            time.sleep(600)  # the test kills the process here
        return await finalize(self, *args, **kwargs)

    temporary.finalize = stalled_finalize

script = Path(__file__).resolve().parents[1] / "train_toy.py"
sys.argv = [str(script), *sys.argv[1:]]
runpy.run_path(str(script), run_name="__main__")
