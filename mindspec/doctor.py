"""`mindspec doctor`: what runs where on this machine, and what an Ascend run still needs.

Prints one line per check (`ok`, `--` not present/not needed, `NO` a problem for the device asked
for), then what would run where. Exit 0 when the device asked for (auto: the one it picks) works,
1 when it does not (or $MINDSPEC_HOME cannot hold models and caches).
"""
import glob
import importlib.metadata
import os
import platform
import shutil
import sys

from .device import ascend_env, asked_device, detect_device
from .errors import MindspecError
from .spec import DEVICE_DTYPES


def _version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _read_version(path):
    """The version in a CANN version.info / version.cfg ("Version=8.3.RC1" style), None if absent."""
    for f in glob.glob(path):
        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition("=")
                if key.strip().lower() in ("version", "toolkit_installed_version") and value.strip():
                    return value.strip().strip('"').split(":")[-1]
    return None


def cann_versions_accepted():
    """The CANN versions the installed MindSpore checks for (its own Ascend environment checker)."""
    try:
        from mindspore.run_check._check_version import AscendEnvChecker
        return list(AscendEnvChecker(None).version)
    except Exception:  # noqa: BLE001 - a MindSpore without the checker: unknown
        return []


INT8_DOT = ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")  # x86 and Arm int8 dot-product flags


def int8_dot(cpuinfo):
    """The int8 dot-product instructions among the flags of /proc/cpuinfo's text (x86 "flags", Arm
    "Features" lines). onnxruntime's 8-bit draft kernels (MatMulNBits, accuracy level 4) are built on
    them: on a CPU with none (AVX2 only: AMD EPYC, 2 cores) a batch of 8 rows cost 5x one row, 90 vs
    18 ms a call with the default draft (README, "Draft formats by CPU")."""
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return [f for f in INT8_DOT if f in flags]


def _int8_row():
    """(status, detail) of the CPU int8 dot-product check."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            found = int8_dot(f.read())
    except OSError:
        return "--", "unknown (no /proc/cpuinfo)"
    if found:
        return "ok", ", ".join(found)
    return "--", ("none: the 8-bit draft's batched and prompt calls cost about one row's time per row "
                  '(README, "Draft formats by CPU")')


def _cpu_smoke():
    """A tiny MindSpore graph and a tiny onnxruntime session on the CPU; None when both run, else why."""
    import numpy as np
    try:
        import mindspore as ms
        from mindspore import Tensor, nn, ops
        ms.set_context(mode=ms.GRAPH_MODE)
        ms.set_device("CPU")

        class MatMul(nn.Cell):
            def construct(self, a, b):
                return ops.matmul(a, b)
        out = MatMul()(Tensor(np.ones((2, 3), np.float32)), Tensor(np.ones((3, 2), np.float32))).asnumpy()
        if not np.allclose(out, 3):
            return "MindSpore CPU graph gave a wrong matmul"
        import onnxruntime as ort
        from onnx import TensorProto, helper
        g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "smoke",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in "ab"],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 2])])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        one = np.ones((2, 2), np.float32)
        if not np.allclose(s.run(None, {"a": one, "b": one})[0], 2):
            return "onnxruntime CPU gave a wrong matmul"
    except Exception as e:  # noqa: BLE001 - report, do not crash
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def checks(device=None):
    """[(status, name, detail)] and the device it resolves to (or the error)."""
    rows = []
    add = lambda ok, name, detail: rows.append((ok, name, detail))  # noqa: E731
    a = ascend_env()
    add("ok", "host", f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    ms_v, ort_v = _version("mindspore"), _version("onnxruntime-cann") or _version("onnxruntime")
    arch_ok = a.mindspore_arch in (None, a.host_arch)
    ok, detail = _int8_row()
    add(ok, "CPU int8 dot product", detail)
    add("ok" if ms_v and arch_ok else "NO", "MindSpore",
        f"{ms_v or 'not installed'}; native libraries {a.mindspore_arch or '?'}"
        + ("" if arch_ok else f" on a {a.host_arch} host: install MindSpore's {a.host_arch} wheel"))
    accepted = cann_versions_accepted()
    add("ok" if accepted else "--", "CANN versions MindSpore accepts", ", ".join(accepted) or "unknown")
    try:
        import onnxruntime as ort
        prov = ort.get_available_providers()
    except ImportError:
        prov = []
    add("ok" if ort_v else "NO", "onnxruntime", f"{ort_v or 'not installed'}; providers {', '.join(prov) or '-'}")
    add("ok" if a.npus else "--", "NPUs visible", ", ".join(f"davinci{n}" for n in a.npus) or "none")
    drv = a.driver and _read_version(os.path.join(a.driver, "version.info"))
    add("ok" if a.driver else "--", "Ascend driver", f"{a.driver} {drv or ''}".strip() if a.driver else "not found")
    tk = a.toolkit and (_read_version(os.path.join(a.toolkit, "compiler", "version.info"))
                        or _read_version(os.path.join(a.toolkit, "*", "ascend_toolkit_install.info")))
    in_range = not tk or not accepted or any(tk.startswith(v) for v in accepted)
    add(("ok" if in_range else "NO") if a.toolkit else "--", "CANN toolkit",
        (f"{a.toolkit} {tk or ''}".strip() + ("" if in_range else f" (MindSpore {ms_v} wants {', '.join(accepted)})"))
        if a.toolkit else "not found")
    add("ok" if a.sourced else "--", "CANN environment (set_env.sh)", "sourced" if a.sourced else "not sourced")
    add("ok" if shutil.which("npu-smi") else "--", "npu-smi", shutil.which("npu-smi") or "not on PATH")
    beside = os.path.join(os.path.dirname(sys.executable), "msrun")  # where --tp looks first
    msrun = beside if os.path.exists(beside) else shutil.which("msrun")
    add("ok" if msrun else "NO", "msrun (--tp)", msrun or "not found beside Python or on PATH")
    cann_ep = "CANNExecutionProvider" in prov
    add("ok" if cann_ep else "--", "onnxruntime CANN provider", "compiled in" if cann_ep else "absent (CPU-only wheel)")
    smoke = _cpu_smoke()
    add("ok" if smoke is None else "NO", "CPU run (MindSpore graph + onnxruntime)", smoke or "works")
    missing = a.missing()
    add("ok" if not missing else "--", "Ascend ready", "yes" if not missing else "; ".join(missing))
    try:
        chosen = detect_device(device, a)
    except MindspecError as e:
        chosen = e
    return rows, chosen


def _home_row():
    """Where models, the compile cache and the measured costs go ($MINDSPEC_HOME): every model command needs
    it, or the directory it will be made in (doctor makes nothing)."""
    from .default import home_path
    path = there = os.path.abspath(home_path())
    while not os.path.exists(there):  # the nearest part that exists must be a directory it can write in
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        return "NO", f"{path}: {there} is not a directory: every model command fails (set MINDSPEC_HOME)"
    if not os.access(there, os.W_OK | os.X_OK):
        return "NO", f"{path}: {there} is not writable: every model command fails (set MINDSPEC_HOME)"
    return ("ok", path) if there == path else ("--", f"{path} (made on first use)")


def run(device=None, out=sys.stdout):
    asked, _ = asked_device(device)  # (a bad value: exit 2, before any check)
    rows, chosen = checks(device)
    home, where = _home_row()
    rows.append((home, "models and caches (MINDSPEC_HOME)", where))
    w = max(len(name) for _, name, _ in rows)
    for ok, name, detail in rows:
        print(f"{ok:<3} {name:<{w}}  {detail}", file=out)
    if isinstance(chosen, MindspecError):
        print(f"\n{asked}: cannot run: {chosen}", file=out)
        return 1
    dtype = DEVICE_DTYPES[chosen][0]
    draft = "onnxruntime CANNExecutionProvider" if chosen == "Ascend" else "onnxruntime CPUExecutionProvider"
    ranks = "msrun ranks, HCCL" if chosen == "Ascend" else "msrun ranks, MindSpore CPU collectives"
    print(f"\n{asked} runs on {chosen}: target MindSpore GRAPH_MODE on {chosen} "
          f"(default --dtype {dtype}); draft {draft}; --tp N: {ranks}", file=out)
    smoke_failed = any(ok == "NO" and name.startswith("CPU run") for ok, name, _ in rows)
    return 1 if chosen == "CPU" and smoke_failed or home == "NO" else 0
