"""Device selection with faked Ascend environments (roots and /dev in a temp dir): auto picks Ascend only
when it can run, `--device ascend` says exactly what is missing, the draft never falls back to the host
silently, and onnxruntime's fallback notice never reaches stdout."""
import os
import re
import subprocess
import sys

import pytest

from mindspec.device import (AscendEnv, ascend_env, check_device_env, check_tp, detect_device, device_id, elf_arch,
                             mindspore_arch)
from mindspec.errors import MindspecError
from mindspec.doctor import int8_dot
from mindspec.export import DraftSession


def fake(tmp_path, npus=(0, 1), driver=True, toolkit=True):
    """(root, dev) of a fake Ascend machine."""
    root, dev = tmp_path / "Ascend", tmp_path / "dev"
    dev.mkdir()
    for n in npus:
        (dev / f"davinci{n}").touch()
    (dev / "davinci_manager").touch()  # not an NPU
    if driver:
        (root / "driver").mkdir(parents=True)
    if toolkit:
        (root / "ascend-toolkit" / "latest").mkdir(parents=True)
    return str(root), str(dev)


def probe(tmp_path, env=None, **kw):
    root, dev = fake(tmp_path, **kw)
    return ascend_env(env or {}, root, dev, ms_arch="x86_64", host_arch="x86_64")


def test_this_machine_runs_cpu():
    assert detect_device() == "CPU" and detect_device("cpu") == "CPU"
    with pytest.raises(MindspecError, match="^--device ascend: no NPU is visible"):
        detect_device("ascend")


def test_ready_ascend_machine(tmp_path):
    a = probe(tmp_path, {"ASCEND_HOME_PATH": str(tmp_path / "Ascend" / "ascend-toolkit" / "latest")})
    assert a.npus == [0, 1] and a.missing() == []
    assert detect_device(None, a) == detect_device("ascend", a) == "Ascend"
    assert detect_device("cpu", a) == "CPU"
    check_tp(2, "Ascend", a)
    with pytest.raises(MindspecError, match=r"^--tp 8 needs 8 NPUs, 2 visible$"):
        check_tp(8, "Ascend", a)
    check_tp(8, "CPU", a)  # CPU ranks are processes
    check_tp(1, "Ascend", a, replicas=2)
    # the dp prober's: `batch --dp` never counted NPUs; replicas past them saw none and ran on the host
    with pytest.raises(MindspecError, match=r"^--dp 2 x --tp 2 needs 4 NPUs, 2 visible$"):
        check_tp(2, "Ascend", a, replicas=2)


def test_npus_without_the_cann_environment_is_an_error_not_a_host_run(tmp_path):
    a = probe(tmp_path)  # toolkit installed, set_env.sh not sourced
    with pytest.raises(MindspecError) as e:
        detect_device(None, a)
    assert str(e.value) == (f"NPUs are visible but cannot be used: the CANN environment is not set (source "
                            f"{a.toolkit}/../set_env.sh) (or pass --device cpu)")
    assert detect_device("cpu", a) == "CPU"


@pytest.mark.parametrize("kw, words", [(dict(npus=()), "no NPU is visible"), (dict(driver=False), "no Ascend driver"),
                                       (dict(toolkit=False), "no CANN toolkit")])
def test_ascend_says_what_is_missing(tmp_path, kw, words):
    a = probe(tmp_path, **kw)
    with pytest.raises(MindspecError, match=f"^--device ascend: {words}"):
        detect_device("ascend", a)


def test_an_environment_naming_no_toolkit_is_not_a_toolkit(tmp_path):
    """ASCEND_HOME_PATH=/nonexistent made doctor say "ok CANN toolkit /nonexistent", sourced."""
    a = probe(tmp_path, {"ASCEND_HOME_PATH": "/nonexistent"}, toolkit=False)
    assert a.toolkit is None and not a.sourced
    assert "no CANN toolkit (/usr/local/Ascend/ascend-toolkit; ASCEND_HOME_PATH /nonexistent does not exist)" in a.missing()


def test_visible_devices_and_wheel_architecture(tmp_path):
    root, dev = fake(tmp_path, npus=(0, 1, 2, 3))
    a = ascend_env({"ASCEND_RT_VISIBLE_DEVICES": "1,3", "ASCEND_HOME_PATH": str(tmp_path)}, root, dev,
                   ms_arch="x86_64", host_arch="aarch64")
    assert a.npus == [1, 3]
    assert a.missing() == ["the installed MindSpore has x86_64 binaries on this aarch64 host "
                           "(install the aarch64 wheel)"]
    assert mindspore_arch() == elf_arch(sys.executable) == "x86_64"  # this machine: consistent
    assert elf_arch(__file__) is None


def test_device_numbers_npu_lists_and_device_names_as_written(tmp_path, monkeypatch):
    """Mutation testing's: each of these could change unseen (a bound dropped, an empty item read as an
    NPU, a name's case or its npu alias)."""
    for ok in ("3", " 3 ", "", "2147483647"):
        check_device_env({"DEVICE_ID": ok, "ASCEND_DEVICE_ID": ok})
    for bad in ("-1", "2147483648", "1.0", "x"):  # (MindSpore's import aborts on what is not a uint32 id)
        with pytest.raises(MindspecError, match=f"^ASCEND_DEVICE_ID=\"{re.escape(bad)}\" is not a device number"):
            check_device_env({"ASCEND_DEVICE_ID": bad})
    root, dev = fake(tmp_path, npus=(0, 1, 2, 3))
    lists = {spec: ascend_env({"ASCEND_RT_VISIBLE_DEVICES": spec}, root, dev, ms_arch="x86_64",
                              host_arch="x86_64").npus for spec in ("", "1,,3", " 2 ,x", "2,x", "1, 2,3", "1,3,8", "0,0", "2,1")}
    # as CANN reads it: up to the first item that is not an id of a device present, in ascending order
    assert lists == {"": [], "1,,3": [1], " 2 ,x": [], "2,x": [2], "1, 2,3": [1], "1,3,8": [1, 3], "0,0": [0],
                     "2,1": [2]}
    # an Ascend review's: the ids are logical, indices among the devices present (a container given davinci4..7
    # with ASCEND_RT_VISIBLE_DEVICES=0,1 saw no NPU, and --device auto ran on the host)
    (tmp_path / "container").mkdir()
    root, dev = fake(tmp_path / "container", npus=(4, 5, 6, 7))
    assert ascend_env({"ASCEND_RT_VISIBLE_DEVICES": "0,1"}, root, dev, ms_arch="x86_64", host_arch="x86_64").npus == [4, 5]
    (tmp_path / "ready").mkdir()
    a = probe(tmp_path / "ready", {"ASCEND_HOME_PATH": str(tmp_path / "ready" / "Ascend" / "ascend-toolkit" / "latest")})
    assert detect_device("npu", a) == detect_device("ASCEND", a) == "Ascend"
    monkeypatch.setenv("MINDSPEC_DEVICE", "CPU")
    assert detect_device(None, a) == "CPU"


def test_device_flag_and_env(monkeypatch):
    monkeypatch.setenv("MINDSPEC_DEVICE", "cpu")
    assert detect_device() == "CPU"
    with pytest.raises(MindspecError, match=r'^device must be one of auto, cpu, ascend, got "gpu"$'):
        detect_device("gpu")
    monkeypatch.setenv("MINDSPEC_DEVICE", "bogus")  # (the CLI prober's: it said --device, never given)
    with pytest.raises(MindspecError, match="^MINDSPEC_DEVICE must be one of auto, cpu, ascend.*got \"bogus\"$"):
        detect_device()
    assert device_id({"DEVICE_ID": "5", "ASCEND_DEVICE_ID": "0"}) == 5  # the rank's, not the inherited one
    assert device_id({"ASCEND_DEVICE_ID": "2"}) == 2 and device_id({}) == 0


def test_draft_refuses_a_silent_cpu_fallback_and_keeps_stdout_clean(tiny_target, noisy_draft, tmp_path, capfd):
    """onnxruntime-cann here has the CANN provider compiled in but no CANN libraries: asked for it, it
    prints a fall-back notice on stdout and runs on the CPU. That must be an error, on stderr only. A cpu-profile
    draft is refused on Ascend before any session (an Ascend review's: CANN left its com.microsoft ops to the
    host, and the draft said it ran on CANN); the session itself forbids onnxruntime a node on the host."""
    from mindspec.export import export_draft
    from mindspec.export.runtime import make_session_options, start_session
    with pytest.raises(MindspecError, match=r"^draft .* is exported with the cpu profile, whose ops CANN does not run: "
                                            r"export it for the NPU with `mindspec export --profile ascend`$"):
        DraftSession(noisy_draft, device="Ascend")
    ascend = str(tmp_path / "ascend.onnx")
    export_draft(tiny_target[0], ascend, max_seq=64, profile="ascend")
    capfd.readouterr()
    with pytest.raises(MindspecError, match=r"^draft .*ascend.onnx: onnxruntime could not start CANNExecutionProvider: "
                                            r"install onnxruntime-cann and source CANN's set_env.sh$"):
        DraftSession(ascend, device="Ascend")
    out = capfd.readouterr()  # (onnxruntime's own log says why: no libascendcl.so here)
    assert out.out == "" and "libascendcl.so" in out.err and "Falling back" not in out.err
    # (a node CANN leaves to the host is onnxruntime's error then; without CANN here, only the setting is seen)
    so = make_session_options()
    with pytest.raises(MindspecError):
        start_session(ascend, so, [("CANNExecutionProvider", {"device_id": 0})])
    assert so.get_session_config_entry("session.disable_cpu_ep_fallback") == "1"


def test_cli_device_ascend_is_one_line(tiny_target):
    p = subprocess.run([sys.executable, "-m", "mindspec", "generate", "--target", tiny_target[0], "--no-speculate",
                        "--prompt-ids", "5", "--device", "ascend"], capture_output=True, text=True,
                       env=dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]))
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == ["mindspec: error: --device ascend: " + "; ".join(
        AscendEnv.missing(ascend_env()))]


def test_doctor_on_this_machine():
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    p = subprocess.run([sys.executable, "-m", "mindspec", "doctor"], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    lines = {line[4:].split("  ")[0].strip(): line[:3].strip() for line in p.stdout.splitlines() if line[:3].strip()}
    assert lines["CPU run (MindSpore graph + onnxruntime)"] == "ok" and lines["MindSpore"] == "ok"
    assert lines["Ascend ready"] == "--" and "no NPU is visible" in p.stdout
    with open("/proc/cpuinfo") as f:  # the int8 check names what this CPU has
        assert lines["CPU int8 dot product"] == ("ok" if int8_dot(f.read()) else "--")
    assert "CANN versions MindSpore accepts          8." in p.stdout  # read from the installed MindSpore
    assert p.stdout.strip().splitlines()[-1].startswith("--device auto runs on CPU: target MindSpore GRAPH_MODE on CPU")
    p = subprocess.run([sys.executable, "-m", "mindspec", "doctor", "--device", "ascend"], capture_output=True,
                       text=True, env=env)
    assert p.returncode == 1 and "--device ascend: cannot run: --device ascend: no NPU is visible" in p.stdout
    # the dp prober's: MINDSPEC_DEVICE=ascend was called "--device auto" and "--device ascend"
    p = subprocess.run([sys.executable, "-m", "mindspec", "doctor"], capture_output=True, text=True,
                       env=dict(env, MINDSPEC_DEVICE="ascend"))
    assert p.returncode == 1 and p.stdout.strip().splitlines()[-1].startswith(
        "MINDSPEC_DEVICE=ascend: cannot run: MINDSPEC_DEVICE=ascend: no NPU is visible"), p.stdout
    # a bad value is a usage error, as for every other command (it was exit 1)
    p = subprocess.run([sys.executable, "-m", "mindspec", "doctor"], capture_output=True, text=True,
                       env=dict(env, MINDSPEC_DEVICE="gpu"))
    assert p.returncode == 2 and p.stdout == "" and p.stderr == \
        "mindspec: error: MINDSPEC_DEVICE must be one of auto, cpu, ascend, got \"gpu\"\n", p.stderr


def test_doctor_checks_the_model_home(tmp_path):
    """The dp prober's: MINDSPEC_HOME naming a file made every model command fail while doctor said all ok."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    (tmp_path / "afile").write_text("")
    for home, mark, words, code in ((tmp_path / "afile", "NO", "is not a directory", 1),
                                    (tmp_path / "afile" / "sub", "NO", f"{tmp_path / 'afile'} is not a directory", 1),
                                    (tmp_path / "new", "--", "made on first use", 0),
                                    (tmp_path, "ok", str(tmp_path), 0)):
        p = subprocess.run([sys.executable, "-m", "mindspec", "doctor"], capture_output=True, text=True,
                           env=dict(env, MINDSPEC_HOME=str(home)))
        row = next(line for line in p.stdout.splitlines() if line[4:].startswith("models and caches"))
        assert p.returncode == code and row[:3].strip() == mark and words in row, (p.stdout, p.stderr)
    assert not (tmp_path / "new").exists()  # doctor makes nothing


def test_int8_dot_product_flags_from_cpuinfo():
    x86 = "processor\t: 0\nflags\t\t: fpu sse avx2 fma avx512f avx512_vnni\nprocessor\t: 1\nflags\t\t: fpu avx2 avx512_vnni\n"
    assert int8_dot(x86) == ["avx512_vnni"]
    assert int8_dot("flags\t\t: fpu sse avx avx2 fma\n") == []  # AVX2 only (AMD EPYC Zen 2)
    assert int8_dot("Features\t: fp asimd evtstrm aes asimddp sve i8mm\n") == ["asimddp", "i8mm"]  # Arm
    assert int8_dot("model name\t: avx512_vnni in a name is not a flag\n") == []
