"""Where MindSpore writes a failed compile's dump (rank_N/om/analyze_fail.ir, by default into the current
directory): a temporary directory ($MS_OM_PATH) a command removes at its end unless something was written
there. A stopped compile writes one too. A user's own MS_OM_PATH is left alone."""
import os
import shutil
import tempfile


class OmDir:
    def __init__(self):
        self.path = None  # (remove() may come first: a second signal before __enter__)

    def __enter__(self):
        self.path = None
        if "MS_OM_PATH" not in os.environ:
            self.path = os.environ["MS_OM_PATH"] = tempfile.mkdtemp(prefix="mindspec-om-")
        return self

    def __exit__(self, *exc):
        self.remove()

    def remove(self):
        if self.path is not None:
            os.environ.pop("MS_OM_PATH", None)
            if not any(files for _, _, files in os.walk(self.path)):
                shutil.rmtree(self.path, ignore_errors=True)
            self.path = None
