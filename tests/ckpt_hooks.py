"""The real trainer with one test hook, picked by TITANLITE_TEST_HOOK.

resave          right after loading, write what was loaded to <dump>/checkpoint-resaved/step-N
                and train on, so a test can compare it tensor by tensor with the source.
kill_at_step=N  SIGKILL this process in the middle of saving step N: every data file is
                written, the metadata and the commit are not.
log_compiles    log each function Dynamo starts tracing (TORCH_LOGS=dynamo would not reach a
                rank: it is read when torch is imported, which the harness's fork server did), to
                <dump>/logs/rank-R.log with the rest of stderr that is not titanlite's.
chunk_bytes=N   the loss in chunks of N bytes of float32 logits (titanlite.loss.CHUNK_BYTES), so a
                tiny model's loss runs chunked.
"""

import logging
import os
import signal

import torch
from torch.distributed.checkpoint import FileSystemWriter

from titanlite import loss, train
from titanlite.checkpoint.dcp import CheckpointManager

HOOK = os.environ.get("TITANLITE_TEST_HOOK", "")

if HOOK == "resave":
    _load = CheckpointManager.maybe_load

    def _load_and_resave(self: CheckpointManager, say: bool = True) -> int:
        step = _load(self, say)
        root, self.root = self.root, self.root.parent / "checkpoint-resaved"
        self._save(step)
        self._finish_pending(block=True)
        self.root = root
        return step

    CheckpointManager.maybe_load = _load_and_resave
elif HOOK.startswith("kill_at_step="):
    _finish = FileSystemWriter.finish
    _doomed = f"step-{HOOK.split('=')[1]}.tmp"

    def _finish_or_die(self: FileSystemWriter, *args, **kwargs):
        if str(self.path).endswith(_doomed):
            os.kill(os.getpid(), signal.SIGKILL)
        return _finish(self, *args, **kwargs)

    FileSystemWriter.finish = _finish_or_die
elif HOOK == "log_compiles":
    torch._logging.set_logs(dynamo=logging.INFO)
elif HOOK.startswith("chunk_bytes="):
    loss.CHUNK_BYTES = int(HOOK.split("=")[1])
elif HOOK:
    raise SystemExit(f"unknown TITANLITE_TEST_HOOK '{HOOK}'")

if __name__ == "__main__":
    train.main()
