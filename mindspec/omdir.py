"""Where MindSpore writes a failed compile's dump (rank_N/om/analyze_fail.ir, by default into the current
directory): a temporary directory ($MS_OM_PATH) a command removes at its end unless something was written
there. A stopped compile writes one too. A user's own MS_OM_PATH is left alone. A command killed outright
leaves its directory: the next command removes it if it stayed empty (scratch.py)."""
import os

from . import scratch

PREFIX = "mindspec-om-"


class OmDir:
    def __init__(self):
        self.path = None  # (remove() may come first: a second signal before __enter__)

    def __enter__(self):
        self.path = None
        if "MS_OM_PATH" not in os.environ:
            self.path = os.environ["MS_OM_PATH"] = scratch.mkdtemp(PREFIX, only_empty=True)
        return self

    def __exit__(self, *exc):
        self.remove()

    def remove(self):
        if self.path is not None:
            os.environ.pop("MS_OM_PATH", None)
            scratch.remove(self.path, only_empty=True)
            self.path = None
