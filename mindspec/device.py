"""Which device runs the target and the draft: one rule for both, checked before anything loads.

`--device auto` (the default) picks Ascend when an NPU is visible and CPU otherwise; NPUs visible but
the CANN environment not usable is an error, not a silent fall back to the host. `--device ascend`
refuses with one line saying what is missing. The probes read only files and environment variables
(no framework import), and take the environment and roots as arguments so they can be tested with
faked ones.
"""
import glob
import os
import platform
import re
import sys
from dataclasses import dataclass, field

from .errors import MindspecError, shown

ASCEND_ROOT = "/usr/local/Ascend"
DEVICE_ENV = "MINDSPEC_DEVICE"  # --device, handed to msrun's ranks (they detect the same way)
CHOICES = ("auto", "cpu", "ascend")
_ELF_MACHINE = {62: "x86_64", 183: "aarch64"}


@dataclass
class AscendEnv:
    """What an Ascend run needs, as found: the CANN toolkit (and whether set_env.sh was sourced), the
    driver, the visible NPUs, and the architecture of MindSpore's native libraries."""
    toolkit: str = None
    sourced: bool = False
    driver: str = None
    npus: list = field(default_factory=list)
    host_arch: str = ""
    mindspore_arch: str = None
    stale_home: str = None  # ASCEND_HOME_PATH (or ASCEND_TOOLKIT_HOME) naming no directory

    def missing(self):
        """What stops an Ascend run, one phrase each (empty: ready)."""
        out = []
        if not self.npus:
            out.append("no NPU is visible (/dev/davinciN; `npu-smi info` lists them)")
        if not self.driver:
            out.append(f"no Ascend driver ({ASCEND_ROOT}/driver)")
        if not self.toolkit:
            stale = f"; ASCEND_HOME_PATH {self.stale_home} does not exist" if self.stale_home else ""
            out.append(f"no CANN toolkit ({ASCEND_ROOT}/ascend-toolkit{stale})")
        elif not self.sourced:
            out.append(f"the CANN environment is not set (source {self.toolkit}/../set_env.sh)")
        if self.mindspore_arch and self.mindspore_arch != self.host_arch:
            out.append(f"the installed MindSpore has {self.mindspore_arch} binaries on this {self.host_arch} "
                       f"host (install the {self.host_arch} wheel)")
        return out


def visible_list(env, present=None):
    """The devices ASCEND_RT_VISIBLE_DEVICES lists (None when unset or empty), read as CANN reads it: logical ids
    (indices among the devices present: a container's /dev/davinci4..7 are 0..3), up to the first item that is not
    one — another character (a space), an id not above the one before, or with `present` devices an id past them
    ("1, 2,3" is 1; "1,3,8" of 4 is 1, 3)."""
    spec = env.get("ASCEND_RT_VISIBLE_DEVICES")
    if not spec:
        return None
    ids = []
    for x in spec.split(","):
        if not (x.isascii() and x.isdigit()) or (present is not None and int(x) >= present) \
                or (ids and int(x) <= int(ids[-1])):  # (CANN takes them in ascending order only: "0,0" is one)
            break
        ids.append(x)
    return ids


def narrowed(ids, tp):
    """The environment of a process (and its msrun ranks) that is to see only devices `ids` (as the system
    names them), which it sees as 0..len-1: at tp 1 its device is 0 (no msrun sets it: an inherited
    ASCEND_DEVICE_ID would point past them), else each rank sets its own. None: remove."""
    return {"ASCEND_RT_VISIBLE_DEVICES": ",".join(ids),
            **({"DEVICE_ID": "0", "ASCEND_DEVICE_ID": "0"} if tp == 1 else {"ASCEND_DEVICE_ID": None})}


def _visible(npus, env):
    """The NPUs (/dev/davinciN numbers, physical) ASCEND_RT_VISIBLE_DEVICES leaves a process (its logical ids:
    indices among them)."""
    if env.get("ASCEND_RT_VISIBLE_DEVICES") is None:
        return npus
    return [npus[int(i)] for i in visible_list(env, len(npus)) or []]


def elf_arch(path):
    """The machine an ELF file was built for ("x86_64", "aarch64", ...), None if unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return None
    if head[:4] != b"\x7fELF":
        return None
    machine = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
    return _ELF_MACHINE.get(machine, f"machine {machine}")


def mindspore_arch():
    """Architecture of the installed MindSpore's native libraries (without importing it)."""
    import importlib.util
    spec = importlib.util.find_spec("mindspore")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "lib", "*.so*")))
    return elf_arch(libs[0]) if libs else None


def ascend_env(env=None, root=ASCEND_ROOT, dev="/dev", ms_arch=None, host_arch=None):
    """Probe an Ascend setup (env, root and dev default to this machine's)."""
    env = os.environ if env is None else env
    named = env.get("ASCEND_HOME_PATH") or env.get("ASCEND_TOOLKIT_HOME")
    home = named if named and os.path.isdir(named) else None  # a stale env var is no toolkit
    latest = os.path.join(root, "ascend-toolkit", "latest")
    toolkit = home or (latest if os.path.isdir(latest) else None)
    driver = os.path.join(root, "driver")
    npus = sorted(int(m.group(1)) for p in glob.glob(os.path.join(dev, "davinci*"))
                  if (m := re.fullmatch(r"davinci(\d+)", os.path.basename(p))))
    return AscendEnv(toolkit=toolkit, sourced=bool(home), driver=driver if os.path.isdir(driver) else None,
                     stale_home=named if named and not home else None,
                     npus=_visible(npus, env), host_arch=host_arch or platform.machine(),
                     mindspore_arch=ms_arch if ms_arch is not None else mindspore_arch())


def detect_device(device=None, probe=None):
    """"CPU" or "Ascend" for --device (None: $MINDSPEC_DEVICE, else auto). `probe`: an AscendEnv
    (default: this machine's)."""
    label, device = asked_device(device)
    if device == "cpu":
        return "CPU"
    a = probe or ascend_env()
    if device == "auto" and not a.npus:
        return "CPU"
    problems = a.missing()
    if problems:
        why = "; ".join(problems)
        if device == "auto":
            raise MindspecError(f"NPUs are visible but cannot be used: {why} (or pass --device cpu)")
        raise MindspecError(f"{label}: {why}")
    return "Ascend"


def asked_device(device=None):
    """(how the user asked, in their words: '--device X' or 'MINDSPEC_DEVICE=X'; the device asked for: auto,
    cpu, ascend or npu) for --device (None: $MINDSPEC_DEVICE, else auto); a bad value is refused by name."""
    env = os.environ.get(DEVICE_ENV)
    value = str(device or env or "auto").lower()
    label = f"{DEVICE_ENV}={env}" if not device and env else f"--device {value}"
    if value not in ("auto", "cpu", "ascend", "npu"):
        source = "device" if device or not env else DEVICE_ENV
        raise MindspecError(f"{source} must be one of {', '.join(CHOICES)}, got {shown(device or env)}")
    return label, value


def check_tp(tp, device, probe=None, replicas=1, dp=None):
    """--tp N on Ascend needs N visible NPUs (one rank per NPU); `replicas` data-parallel replicas of it
    on this machine need as many times N (dp: how they were asked for, e.g. "--dp 8 over --nodes 2")."""
    if device == "Ascend":
        n = len((probe or ascend_env()).npus)
        if tp * replicas > n:
            what = f"--tp {tp}" if replicas == 1 else f"{dp or f'--dp {replicas}'} x --tp {tp}"
            raise MindspecError(f"{what} needs {tp * replicas} NPUs, {n} visible")


def check_device_env(env=None):
    """What MindSpore's import aborts the process on, checked before it loads: DEVICE_ID / ASCEND_DEVICE_ID,
    when set, are device numbers (a negative one: std::runtime_error in UlongToUint), and the working
    directory exists (its import calls os.getcwd(): found, a FileNotFoundError inside it, then
    "Fatal Python error" and exit 134)."""
    env = os.environ if env is None else env
    try:
        if "mindspore" not in sys.modules:  # (once imported, a process whose directory went still runs)
            os.getcwd()
    except FileNotFoundError:
        raise MindspecError("the working directory no longer exists (removed since this process started): cd to "
                            "one that does") from None
    for name in ("DEVICE_ID", "ASCEND_DEVICE_ID"):
        v = env.get(name)
        if v not in (None, "") and not (re.fullmatch(r"\s*[0-9]+\s*", v) and int(v) < 2 ** 31):
            raise MindspecError(f"{name}={shown(v)} is not a device number (an integer >= 0)")


def device_id(env=None):
    """This process's NPU: msrun's per-rank DEVICE_ID first (an ASCEND_DEVICE_ID inherited from an
    Ascend env script would put every rank on NPU 0), then ASCEND_DEVICE_ID, else 0."""
    env = os.environ if env is None else env
    return int(env.get("DEVICE_ID") or env.get("ASCEND_DEVICE_ID") or 0)
