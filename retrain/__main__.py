"""`python -m retrain`: the `retrain` command, also what torchrun starts on every rank
(`torchrun --nproc-per-node N -m retrain config.toml`; docs/distributed.md)."""

import atexit
import os
import sys

from retrain.cli.main import main

if __name__ == "__main__":
    code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A rank under torchrun: after a finished run a C++ thread of torch.distributed
        # (gloo, the TCP store) could still be joinable when the interpreter's teardown
        # destroyed it, which aborted the rank ("terminate called without an active
        # exception", exit -6, no Python frame) after its last line, and torchrun then
        # reported the whole job failed. Python's own exit work runs (atexit: logging,
        # wandb, servers), the streams are flushed, and the rank leaves without that
        # teardown, with the run's exit code.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 0)
    sys.exit(code)
