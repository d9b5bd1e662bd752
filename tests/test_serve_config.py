"""`mindspec serve --config` (MindIE Service's config.json layout + a "mindspec" block) and `--api-key`,
on a real server over real HTTP; then a hypothesis fuzz of every endpoint's body on the same server:
never a 5xx, never a hang, one-line JSON errors, and the same answers afterwards."""
import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from mindspec.errors import MindspecError
from mindspec.export import export_draft

KEY = "sekret"
MAX_SEQ = 128


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def config(tiny_target, tiny_draft_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("serveconfig")
    draft = str(d / "draft.onnx")
    export_draft(tiny_draft_ckpt[0], draft)
    cfg = {
        "Version": "1.0.0",
        "LogConfig": {"logLevel": "Info"},
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": 0, "maxLinkNum": 50, "httpsEnabled": False,
                         "managementPort": 0, "metricsPort": _free_port(), "tokenTimeout": 600},
        "BackendConfig": {
            "npuDeviceIds": [[0]],
            "ModelDeployConfig": {"maxSeqLen": MAX_SEQ, "maxInputTokenLen": 40, "truncation": False,
                                  "ModelConfig": [{"modelName": "fromconfig", "modelWeightPath": tiny_target[0],
                                                   "worldSize": 1, "backendType": "ms"}]},
            "ScheduleConfig": {"maxBatchSize": 2, "maxQueueDelayMicroseconds": 5000, "maxIterTimes": 6}},
        "mindspec": {"draft": draft, "speculationGamma": 2, "apiKey": KEY, "colour": "blue"},
        "Extra": 1,
    }
    path = d / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def server(config):
    """(base URL, stderr lines, what the probes answered while it loaded) of a server configured by the
    file; --model-name on the command line wins."""
    p = subprocess.Popen([sys.executable, "-m", "mindspec", "serve", "--config", config, "--model-name", "tiny2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, err, listening = queue.Queue(), [], queue.Queue()

    def read_err():
        for line in p.stderr:
            err.append(line)
            if m := re.search(r"listening on (http://\S+);", line):
                listening.put(m.group(1))
        listening.put(None)  # the end: the server exited

    def read_out():
        for line in p.stdout:
            lines.put(line)
        lines.put(None)

    def next_of(q):
        """q's next item. A server that exited fails the test at once (its reader's None at the end of its
        output, or the process gone); only a live one is waited for (a cold compile cache on a slow CPU:
        ~6 min; pytest's timeout is 900 s)."""
        deadline = time.time() + 800
        while time.time() < deadline:
            try:
                item = q.get(timeout=1)
            except queue.Empty:
                if p.poll() is None:
                    continue
                item = None
            assert item is not None, f"the server exited ({p.wait()}):\n" + "".join(err)[-3000:]
            return item
        raise AssertionError("the server said nothing for 800 s:\n" + "".join(err)[-3000:])

    threading.Thread(target=read_out, daemon=True).start()
    threading.Thread(target=read_err, daemon=True).start()
    try:
        base, loading = next_of(listening), []
        while lines.empty() and p.poll() is None:  # until "serving": the probes and an inference request, as
            loading.append((call(base, "/v2/health/ready", key=None)[0], call(base, "/v2/health/live", key=None)[0],
                            call(base, "/v1/completions", {"prompt": "hi"})))  # a balancer would
        while not (line := next_of(lines)).startswith("mindspec: serving "):
            pass
        # (another name: fail now; a float16 prober's: nothing said which precision ran)
        assert line == f"mindspec: serving tiny2 on {base} (up to 2 requests at once; float32 on CPU)\n"
        yield base, err, loading
    finally:
        p.terminate()
        p.wait(timeout=60)


def test_ready_only_after_warm_up(server):
    """While the model loads and compiles, ready is 503, live 200, inference 503 "still loading"."""
    _, _, loading = server
    assert loading and loading[0][:2] == (503, 200)
    status, text = loading[0][2]
    assert status == 503 and "still loading" in json.loads(text)["error"]["message"]
    assert all(live == 200 for _, live, _ in loading) and all(ready in (503, 200) for ready, _, _ in loading)


def call(base, path, body=None, key=KEY, raw=None, timeout=120, auth=None):
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key or auth:
        headers["Authorization"] = auth or f"Bearer {key}"
    req = urllib.request.Request(base + path, data=data, headers=headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_file_sets_the_flags_and_unknown_keys_are_warned(server):
    base, err, _ = server
    status, text = call(base, "/v1/models")
    assert status == 200 and [(m["id"], m["max_model_len"]) for m in json.loads(text)["data"]] == [("tiny2", MAX_SEQ)]
    c = json.loads(call(base, "/v1/completions", {"prompt": [5, 6, 7, 8]})[1])
    assert c["usage"]["completion_tokens"] == 6 or c["choices"][0]["finish_reason"] == "stop"  # maxIterTimes
    assert c["mindspec"]["k_used"].keys() <= {"0", "1", "2"} and c["mindspec"]["drafted"] > 0  # the draft, K=2
    status, text = call(base, "/v1/completions", {"prompt": [5] * 41})  # maxInputTokenLen
    assert status == 400 and "prompt is 41 tokens, more than this server's limit of 40" in text
    assert json.loads(text)["error"]["param"] == "prompt"
    status, text = call(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a " * 50}]})
    assert status == 400 and json.loads(text)["error"]["param"] == "messages", text  # (was "prompt": no such field)
    log = "".join(err)
    assert "unknown key mindspec.colour (ignored)" in log and "unknown key Extra (ignored)" in log
    assert "managementPort" not in log and "npuDeviceIds" not in log  # MindIE's own keys: quiet


def test_management_and_metrics_ports_serve_their_planes(server, config):
    """An operator's probe: MindIE's managementPort and metricsPort were ignored, so a deployment's probes and
    scrapes found nothing there. Each now serves its plane (and only it; the main port serves all)."""
    base, err, _ = server
    deadline = time.time() + 30  # (stderr's reader thread may lag behind stdout's "serving")
    while not ((log := "".join(err)).count(" also on http://") == 2 or time.time() > deadline):
        time.sleep(0.1)
    management = re.search(r"mindspec: health probes also on (http://\S+)\n", log)
    metrics = re.search(r"mindspec: /metrics also on (http://\S+)\n", log)
    assert management and metrics, log
    management, metrics = management.group(1), metrics.group(1)
    want_port = json.loads(open(config).read())["ServerConfig"]["metricsPort"]
    assert metrics == f"http://127.0.0.1:{want_port}" and management != base != metrics
    for path in ("/health", "/v2/health/ready", "/v2/health/live", "/health/timed", "/v2/models/tiny2/ready"):
        assert call(management, path, key=None) == call(base, path, key=None) and \
            call(management, path, key=None)[0] == 200, path
        assert call(metrics, path, key=None)[0] == 404, path
    assert call(metrics, "/metrics", key=None)[0] == 200 and "mindspec_requests_total" in call(metrics, "/metrics")[1]
    for plane in (management, metrics):
        status, text = call(plane, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
        assert status == 404 and "no such endpoint: POST /v1/completions" in text
    assert call(management, "/metrics", key=None)[0] == 404
    assert call(base, "/metrics", key=None)[0] == 200 and call(base, "/health", key=None) == (200, "")


def test_api_key(server):
    base = server[0]
    for key in (None, "wrong"):
        status, text = call(base, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}, key=key)
        assert status == 401 and "API key" in json.loads(text)["error"]["message"]
        status, text = call(base, "/generate", {"inputs": "hi"}, key=key)
        assert status == 401 and json.loads(text)["error_type"] == "validation"
    assert call(base, "/health", key=None) == (200, "")
    assert call(base, "/v2/health/ready", key=None) == (200, "")
    assert call(base, "/metrics", key=None)[0] == 200
    assert call(base, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})[0] == 200
    # a header that is not ASCII was a 500 (hmac refuses str with non-ASCII); the scheme is case-insensitive
    status, text = call(base, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}, key=KEY + "\u00e9")
    assert status == 401 and "API key" in json.loads(text)["error"]["message"]
    assert call(base, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}, auth=f"bearer {KEY}")[0] == 200


BAD_CONFIGS = [  # (file content, the one line expected)
    ({"ServerConfig": {"port": "x"}}, 'ServerConfig.port: must be an integer >= 0 and <= 65535, got "x"'),
    ({"ServerConfig": {"httpsEnabled": True}}, "ServerConfig.httpsEnabled: must be false: mindspec serves plain HTTP"),
    # (it said "plain HTTP" too, the TP server prober found)
    ({"BackendConfig": {"ModelDeployConfig": {"truncation": True}}}, "BackendConfig.ModelDeployConfig.truncation: "
     "must be false or 0: a prompt longer than --max-input-tokens is refused, never cut, got true"),
    ({"BackendConfig": {"ModelDeployConfig": {"truncation": -1}}}, "truncation: must be false or 0: a prompt "),
    ({"BackendConfig": {"ModelDeployConfig": {"truncation": 1}}}, "truncation: must be false or 0: a prompt "),
    ({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"worldSize": 0}]}}},
     "BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize: must be an integer >= 1, got 0"),
    ({"BackendConfig": {"ScheduleConfig": {"maxBatchSize": 2.5}}},
     "BackendConfig.ScheduleConfig.maxBatchSize: must be"),
    ({"BackendConfig": {"ScheduleConfig": {"maxQueueDelayMicroseconds": -1}}},
     "BackendConfig.ScheduleConfig.maxQueueDelayMicroseconds: must be an integer >= 0 and <= 1000000, got -1"),
    # an object where a value belongs was walked into as a block: its check never ran, the default was used
    ({"BackendConfig": {"ScheduleConfig": {"maxQueueDelayMicroseconds": {}}}},
     "BackendConfig.ScheduleConfig.maxQueueDelayMicroseconds: must be an integer >= 0 and <= 1000000, got {}"),
    ({"BackendConfig": {"ModelDeployConfig": {"maxSeqLen": {"a": 1}}}},
     'BackendConfig.ModelDeployConfig.maxSeqLen: must be an integer >= 2, got {"a": 1}'),
    ({"mindspec": {"speculationGamma": "fast"}},
     'mindspec.speculationGamma: must be "auto" or an integer >= 1 and <= 8, got "fast"'),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object"),
    ("[" * 100000 + "]" * 100000, "not valid JSON"),  # deeper than Python's stack: was a RecursionError traceback
    ('{"mindspec": {"apiKey": "\\ud800"}}', "the API key is not valid text"),  # every request was a 500
    # a block of another shape was warned about and skipped, and the server started on the defaults
    ({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": {"modelName": "x"}}}},
     "BackendConfig.ModelDeployConfig.ModelConfig: must be a list of objects (MindIE's layout), got an object"),
    ({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": ["x"]}}},
     "BackendConfig.ModelDeployConfig.ModelConfig[0]: must be an object (MindIE's layout), got a string"),
    ({"ServerConfig": []}, "ServerConfig: must be an object (MindIE's layout), got a list"),
    ({"mindspec": "fast"}, "mindspec: must be an object (MindIE's layout), got a string"),
    # (found by mutation testing: JSON's true is no integer nor number, 0 no false, "" no key)
    ({"ServerConfig": {"maxLinkNum": True}}, "ServerConfig.maxLinkNum: must be an integer >= 1, got true"),
    ({"mindspec": {"draftTemperature": True}}, "mindspec.draftTemperature: must be a number in [0.01, 100], got true"),
    ({"ServerConfig": {"httpsEnabled": 0}},
     "ServerConfig.httpsEnabled: must be false: mindspec serves plain HTTP (put TLS in a proxy), got 0"),
    ({"mindspec": {"apiKey": ""}}, 'mindspec.apiKey: must be a non-empty string, got ""'),
    ({"mindspec": {"dtype": "fp16"}}, 'mindspec.dtype: must be one of float32, float16, bfloat16, got "fp16"'),
    # an operator's probe, moving a MindIE deployment over: each started, where MindIE refuses to
    ({"ServerConfig": {"managementIpAddress": "127.0.0.2"}}, "ServerConfig.managementIpAddress 127.0.0.2 differs "
     "from the main address 127.0.0.1: give ServerConfig.managementPort a port other than the main port"),
    ({"ServerConfig": {"allowAllZeroIpListening": "yes"}},
     'ServerConfig.allowAllZeroIpListening: must be true or false, got "yes"'),
    ({"BackendConfig": {"npuDeviceIds": [[0, 1, 2, 3]]}}, "BackendConfig.npuDeviceIds: 4 devices [0, 1, 2, 3] for 1 "
     "tensor-parallel ranks (worldSize / --tp): give one a rank"),
    ({"BackendConfig": {"npuDeviceIds": [[0, 0]]}}, "BackendConfig.npuDeviceIds: must be a list of lists of distinct"),
    ({"BackendConfig": {"npuDeviceIds": [0, 1]}}, "BackendConfig.npuDeviceIds: must be a list of lists of distinct"),
]


@pytest.mark.parametrize("content,line", BAD_CONFIGS)
def test_bad_config_values_are_refused_with_the_key_path(tmp_path, content, line):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with socket.socket() as held:  # (a file taken for good: a port taken, never a server of the default model)
        held.bind(("127.0.0.1", 0))
        held.listen()
        p = subprocess.run([sys.executable, "-m", "mindspec", "serve", "--config", str(path), "--host", "127.0.0.1",
                            "--port", str(held.getsockname()[1])], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and line in p.stderr, p.stderr
    assert p.stderr.startswith("mindspec: error: ")


def test_flags_override_the_file_and_a_missing_file_is_one_line(tmp_path):
    from mindspec.cli import parse
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"ServerConfig": {"port": 2000, "ipAddress": "0.0.0.0", "allowAllZeroIpListening": True},
                                "BackendConfig": {"ScheduleConfig": {"maxBatchSize": 4, "maxIterTimes": 5,
                                                                     "maxQueueDelayMicroseconds": 20000}}}))
    a = parse(["serve", "--port", "3000", "--config", str(path), "--max-batch", "2"])
    assert (a.port, a.host, a.max_batch, a.max_new_tokens, a.max_queue_delay_us) == (3000, "0.0.0.0", 2, 5, 20000)
    assert parse(["serve", "--config", str(path), "--max-queue-delay-us", "0"]).max_queue_delay_us == 0
    assert parse(["serve"]).max_queue_delay_us == 5000  # MindIE's default
    # a flag given before --config wins too, also when it repeats the default (it was taken as not given)
    a = parse(["serve", "--port", "1025", "--max-new-tokens", "64", "--config", str(path), "--max-batch", "8"])
    assert (a.port, a.host, a.max_batch, a.max_new_tokens) == (1025, "0.0.0.0", 8, 64)
    p = subprocess.run([sys.executable, "-m", "mindspec", "serve", "--config", str(tmp_path / "nope.json")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr == f"mindspec: error: {tmp_path / 'nope.json'}: No such file or directory\n"


def test_npu_device_ids_become_the_visible_devices_and_other_models_are_named(tmp_path, capsys, monkeypatch):
    """An operator's probe: npuDeviceIds were ignored (a deployment on NPUs 4-7 would run on 0-3); a second
    ModelConfig's keys were each an "unknown key"; MindIE 2.0's plugin_params too."""
    from mindspec.cli import parse
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"BackendConfig": {"npuDeviceIds": [[4, 5]], "ModelDeployConfig": {"ModelConfig": [
        {"modelName": "a", "worldSize": 2, "plugin_params": "{\"plugin_type\":\"mtp\"}"},
        {"modelName": "b", "modelWeightPath": "/b", "worldSize": 1}]}}}))
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    assert parse(["serve", "--config", str(path)]).device_env == {"ASCEND_RT_VISIBLE_DEVICES": "4,5",
                                                                  "ASCEND_DEVICE_ID": None}  # (each rank its own)
    err = capsys.readouterr().err
    assert err == (f"mindspec: warning: {path}: BackendConfig.ModelDeployConfig.ModelConfig[1] (b) is not served: "
                   "mindspec serves one model, BackendConfig.ModelDeployConfig.ModelConfig[0]\n"
                   f"mindspec: warning: {path}: BackendConfig.ModelDeployConfig.ModelConfig[0].plugin_params is not "
                   "used: MindIE's speculation plugins (MTP, lookahead) are not used; mindspec speculates with its "
                   "draft (mindspec.draft)\n")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,3,6,7,8,9")  # npuDeviceIds count among these
    assert parse(["serve", "--config", str(path)]).device_env["ASCEND_RT_VISIBLE_DEVICES"] == "8,9"
    import mindspec.tp  # the review's: a rank read its launcher's narrowed devices as the user's, and failed
    monkeypatch.setattr(mindspec.tp, "is_worker", lambda: True)
    assert getattr(parse(["serve", "--config", str(path)]), "device_env", None) is None
    monkeypatch.undo()
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    path.write_text(json.dumps({"BackendConfig": {"npuDeviceIds": [[4]]}}))  # one device: it is device 0
    assert parse(["serve", "--config", str(path)]).device_env == {"ASCEND_RT_VISIBLE_DEVICES": "4", "DEVICE_ID": "0",
                                                                  "ASCEND_DEVICE_ID": "0"}
    capsys.readouterr()
    path.write_text(json.dumps({"BackendConfig": {"npuDeviceIds": [[4, 5]], "ModelDeployConfig": {"ModelConfig": [
        {"worldSize": 2}]}}}))
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,3")
    with pytest.raises(MindspecError, match=r"npuDeviceIds: 5 is not one of the 2 devices "
                                            r"ASCEND_RT_VISIBLE_DEVICES=2,3 leaves visible"):
        parse(["serve", "--config", str(path)])
    with pytest.raises(MindspecError, match=r"2 devices \[4, 5\] for 4 tensor-parallel ranks"):
        parse(["serve", "--config", str(path), "--tp", "4"])


def test_mindie_rules_across_keys_hold_for_the_files_values(tmp_path):
    """0.0.0.0 needs allowAllZeroIpListening, maxInputTokenLen <= maxSeqLen (MindIE refuses to start otherwise);
    a flag given on the command line wins over the file, and is the user's own (the review)."""
    from mindspec.cli import parse
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"ServerConfig": {"ipAddress": "0.0.0.0", "managementIpAddress": "::",
                                                 "managementPort": 2000},
                                "BackendConfig": {"ModelDeployConfig": {"maxSeqLen": 256, "maxInputTokenLen": 300}}}))
    with pytest.raises(MindspecError, match="ServerConfig.ipAddress: 0.0.0.0 listens on every interface, which "
                                            "MindIE allows only with ServerConfig.allowAllZeroIpListening true"):
        parse(["serve", "--config", str(path), "--max-seq", "512"])
    with pytest.raises(MindspecError, match="ServerConfig.managementIpAddress: :: listens on every interface"):
        parse(["serve", "--config", str(path), "--host", "127.0.0.1", "--max-seq", "512"])
    cfg = json.loads(path.read_text())
    del cfg["ServerConfig"]["managementIpAddress"]
    path.write_text(json.dumps(cfg))
    # a MindIE prober's: refused "as MindIE", where MindIE takes min(maxInputTokenLen, maxSeqLen - 1)
    assert parse(["serve", "--config", str(path), "--host", "0.0.0.0"]).max_input_tokens == 255  # (0.0.0.0: the user's)
    assert parse(["serve", "--config", str(path), "--host", "0.0.0.0", "--max-seq", "200"]).max_input_tokens == 199
    assert parse(["serve", "--max-input-tokens", "5000"]).max_input_tokens == 1023  # (the flag's too: 1024 positions)
    for key in ("managementPort", "metricsPort"):  # (the second review: a plane on the main port of another address)
        other = tmp_path / "other.json"
        other.write_text(json.dumps({"ServerConfig": {"managementIpAddress": "127.0.0.2", "managementPort": 3000,
                                                      key: 2000}}))
        with pytest.raises(MindspecError, match=f"ServerConfig.managementIpAddress 127.0.0.2 differs from the main "
                                                f"address 127.0.0.1: give ServerConfig.{key} a port other than the "
                                                f"main port 2000"):
            parse(["serve", "--config", str(other), "--host", "127.0.0.1", "--port", "2000"])
    cfg["ServerConfig"]["managementIpAddress"] = "::"
    cfg["ServerConfig"]["allowAllZeroIpListening"] = True
    path.write_text(json.dumps(cfg))
    a = parse(["serve", "--config", str(path), "--max-seq", "512"])
    assert (a.host, a.management_host, a.management_port, a.max_seq, a.max_input_tokens) == (
        "0.0.0.0", "::", 2000, 512, 300)


def test_real_mindie_files_read_quietly_and_what_they_set_that_is_not_done_is_said(tmp_path, capsys, monkeypatch):
    """A MindIE prober's: MindIE-LLM's shipped config.json gave 19 "unknown key" warnings (metrics TLS, health check,
    layer-wise disaggregation, kvPoolConfig, a model's own keys), while its speculationGamma, LoRA modules,
    pluginParams and tp/dp were "unknown keys (ignored)"; truncation 0, its documented default, was refused; a
    byte-order mark was not valid JSON; MIES_CONTAINER_IP, which wins over ipAddress in MindIE, was ignored."""
    from mindspec.cli import parse
    from mindspec.mindie_config import read
    shipped = {
        "Version": "1.0.0",
        "ServerConfig": {"ipAddress": "127.0.0.1", "managementIpAddress": "127.0.0.2", "port": 1025,
                         "managementPort": 1026, "metricsPort": 1027, "allowAllZeroIpListening": False,
                         "maxLinkNum": 1000, "httpsEnabled": False, "metricsTlsCaFile": ["metrics_ca.pem"],
                         "metricsTlsCert": "c.pem", "metricsTlsPk": "k.pem", "metricsTlsCrlPath": "m/",
                         "metricsTlsCrlFiles": ["crl.pem"], "inferMode": "standard", "tokenTimeout": 600,
                         "e2eTimeout": 600, "layerwiseDisaggregated": False, "layerwiseDisaggregatedRoleType": "",
                         "layerwiseDisaggregatedMasterIpAddress": "127.0.0.3",
                         "layerwiseDisaggregatedSlaveIpAddress": ["127.0.0.4"], "layerwiseDisaggregatedDataPort": 10024,
                         "layerwiseDisaggregatedCrtlPort": [10001, 10002], "HealthCheckConfig": {"npuUsageThreshold": 10},
                         "tlsCrl": "old.pem"},
        "BackendConfig": {"npuDeviceIds": [[0]], "kvPoolConfig": {"backend": "", "configPath": ""},
                          "interNodeTlsCaFile": "x", "ModelDeployConfig": {
                              "maxSeqLen": 2560, "maxInputTokenLen": 2048, "truncation": 0, "ModelConfig": [{
                                  "modelName": "llama_65b", "worldSize": 1, "async_scheduler_wait_time": 120,
                                  "kv_trans_timeout": 10, "kv_link_timeout": 1080,
                                  "models": {"layerwiseDisaggregatedMasterDeviceNum": 2}}]},
                          "ScheduleConfig": {"maxBatchSize": 200, "enableSplit": False, "splitChunkTokens": 512,
                                             "policyType": 0, "bufferResponseEnabled": False, "maxBeamWidth": 1,
                                             "layerwiseDisaggregated": {"nextPHeadPrior": True}}},
        "LogConfig": {"dynamicLogLevel": ""}}
    path = tmp_path / "config.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(shipped).encode())
    values, warnings = read(str(path))
    assert warnings == [] and values["max_input_tokens"] == 2048 and values["model_name"] == "llama_65b"
    model = shipped["BackendConfig"]["ModelDeployConfig"]
    model.update(speculationGamma=4, maxLoras=2, LoraModules=[{"name": "l", "path": "/l", "baseModelName": "m"}])
    model["ModelConfig"][0].update(pluginParams="{}", dp=2, colour=1)
    path.write_text(json.dumps(shipped))
    mc = "BackendConfig.ModelDeployConfig"
    lora = "LoRA adapters are not supported: the model at modelWeightPath is served as it is"
    assert sorted(read(str(path))[1]) == sorted([
        f"{path}: {mc}.speculationGamma is not used: it sizes MindIE's speculation plugins; mindspec's K is "
        "mindspec.speculationGamma (-k)",
        f"{path}: {mc}.maxLoras is not used: {lora}", f"{path}: {mc}.LoraModules is not used: {lora}",
        f"{path}: {mc}.ModelConfig[0].pluginParams is not used: MindIE's speculation plugins (MTP, lookahead) are "
        "not used; mindspec speculates with its draft (mindspec.draft)",
        f"{path}: {mc}.ModelConfig[0].dp is not used: worldSize ranks run tensor-parallel (--tp); no other split of "
        "them is made (data parallel is --dp: whole replicas)",
        f"{path}: unknown key {mc}.ModelConfig[0].colour (ignored)"])
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"ServerConfig": {"ipAddress": "127.0.0.5", "managementIpAddress": "127.0.0.6",
                                                  "managementPort": 2001}}))
    monkeypatch.setenv("MIES_CONTAINER_IP", "127.0.0.3")
    monkeypatch.setenv("MIES_CONTAINER_MANAGEMENT_IP", "127.0.0.4")
    a = parse(["serve", "--config", str(small)])
    assert (a.host, a.management_host) == ("127.0.0.3", "127.0.0.4")
    assert parse(["serve", "--config", str(small), "--host", "127.0.0.9"]).host == "127.0.0.9"  # (a flag wins)


def test_every_key_sets_its_flag_and_the_ranges_include_their_ends(tmp_path, capsys):
    """Found by mutation testing: each key of the file, read into its flag (the server test overrides
    modelName, never sets the rest), with no warning; a range's ends are values it takes."""
    from mindspec.cli import parse
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "ServerConfig": {"ipAddress": "0.0.0.0", "port": 65535, "maxLinkNum": 9, "httpsEnabled": False,
                         "allowAllZeroIpListening": True},
        "BackendConfig": {
            "ModelDeployConfig": {"maxSeqLen": 2, "maxInputTokenLen": 1, "truncation": False,
                                  "ModelConfig": [{"modelName": "m", "modelWeightPath": "/t", "worldSize": 2}]},
            "ScheduleConfig": {"maxBatchSize": 3, "maxIterTimes": 4, "maxQueueDelayMicroseconds": 1000000}},
        "mindspec": {"draft": "/d", "speculationGamma": 8, "draftTemperature": 0.5, "maxQueue": 0, "readTimeout": 7,
                     "apiKey": "k", "stepTimeout": 2.5}}))
    a = vars(parse(["serve", "--config", str(path)]))
    assert {k: a[k] for k in ("host", "port", "max_connections", "max_seq", "max_input_tokens", "model_name", "target",
                              "tp", "max_batch", "max_new_tokens", "max_queue_delay_us", "draft", "k",
                              "draft_temperature", "max_queue", "read_timeout", "api_key", "step_timeout")} == dict(
        host="0.0.0.0", port=65535, max_connections=9, max_seq=2, max_input_tokens=1, model_name="m", target="/t",
        tp=2, max_batch=3, max_new_tokens=4, max_queue_delay_us=1000000, draft="/d", k=8, draft_temperature=0.5,
        max_queue=0, read_timeout=7, api_key="k", step_timeout=2.5)
    assert capsys.readouterr().err == ""
    for block, key, value, dest in (("mindspec", "speculationGamma", "auto", "k"),
                                    ("mindspec", "draftTemperature", 0.01, "draft_temperature"),
                                    ("mindspec", "draftTemperature", 100, "draft_temperature"),
                                    ("ServerConfig", "port", 0, "port"),
                                    ("mindspec", "stepTimeout", 0, "step_timeout")):
        path.write_text(json.dumps({block: {key: value}}))
        assert getattr(parse(["serve", "--config", str(path)]), dest) == value


def _fuzz_strategies():
    """(path, body): bodies of each endpoint's shape whose fields are mostly plausible, now and then junk
    (any JSON value), extreme numbers or unknown keys."""
    from hypothesis import strategies as st
    scalar = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=6)
    junk = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                        max_leaves=6)

    def mostly(good):
        return st.one_of(good, good, good, good, junk)

    extreme = st.sampled_from([0, -1, 1e-46, 1e39, 2 ** 31, 2 ** 32 + 1, 2 ** 63, float("nan"), float("inf")])
    small, prob = st.integers(1, 6), st.floats(0.05, 1.0)
    prompt = mostly(st.text(min_size=1, max_size=12) | st.lists(st.integers(0, 319), min_size=1, max_size=6))
    msgs = mostly(st.lists(st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "system", "assistant"])),
                                                  "content": mostly(st.text(max_size=10))}), min_size=1, max_size=3))
    sampling = {"temperature": mostly(st.floats(0, 3) | extreme), "top_p": mostly(prob | extreme),
                "top_k": mostly(st.integers(0, 400) | extreme), "seed": mostly(st.integers(0, 2 ** 65)),
                "stop": mostly(st.text(max_size=3)), "repetition_penalty": mostly(st.floats(0.5, 2) | extreme),
                "k": mostly(st.sampled_from([0, 1, 2, 3, "auto"])), "min_tokens": mostly(st.integers(0, 3)),
                "stop_token_ids": mostly(st.lists(st.integers(-5, 400), max_size=3)),
                "ignore_eos": mostly(st.booleans()),
                "draft_temperature": mostly(prob | extreme)}
    openai = dict(sampling, max_tokens=mostly(small), stream=mostly(st.booleans()), n=mostly(st.just(1)),
                  model=mostly(st.text(max_size=6)), logprobs=junk, response_format=junk, unknown_key=junk)
    tgi = dict(sampling, max_new_tokens=mostly(small), do_sample=mostly(st.booleans()), details=mostly(st.booleans()),
               return_full_text=mostly(st.booleans()), typical_p=junk, mystery=junk)

    def body(required, optional):
        return st.fixed_dictionaries(required, optional=optional)

    return st.one_of(
        st.tuples(st.just("/v1/completions"), body({"prompt": prompt}, openai)),
        st.tuples(st.just("/v1/chat/completions"), body({"messages": msgs}, openai)),
        st.tuples(st.sampled_from(["/generate", "/generate_stream", "/", "/infer"]),
                  body({"inputs": mostly(st.text(min_size=1, max_size=12))},
                       {"parameters": mostly(body({}, tgi)), "stream": mostly(st.booleans())})),
        st.tuples(st.sampled_from(["/tokenize", "/detokenize"]),
                  body({}, {"prompt": prompt, "tokens": prompt, "messages": msgs})),
        st.tuples(st.sampled_from(["/v1/completions", "/generate", "/tokenize"]), junk))


def test_fuzz_never_a_5xx_nor_a_hang(server):
    """Generated bodies for every endpoint: each gets a 2xx or a 4xx with one line of JSON within the
    timeout; afterwards greedy and seeded answers are what they were before."""
    from hypothesis import HealthCheck, given, settings
    base, err, _ = server
    greedy = {"prompt": [5, 6, 7, 8], "max_tokens": 6}
    seeded = {"prompt": "hello", "max_tokens": 6, "temperature": 1.5, "top_p": 0.9, "seed": 3}
    before = [json.loads(call(base, "/v1/completions", b)[1])["choices"][0]["text"] for b in (greedy, seeded)]
    seen = {}

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_fuzz_strategies())
    def one(case):
        path, body = case
        raw = json.dumps(body, allow_nan=True).encode()
        status, text = call(base, path, raw=raw, timeout=60)
        assert status < 500, (path, body, status, text)
        seen[status] = seen.get(status, 0) + 1
        if status >= 400:
            assert "\n" not in text.strip() and json.loads(text), (path, body, text)

    one()
    print(sorted(seen.items()))
    assert seen.get(200, 0) >= 10 and sum(n for s, n in seen.items() if 400 <= s < 500) >= 10, seen  # both kinds
    after = [json.loads(call(base, "/v1/completions", b)[1])["choices"][0]["text"] for b in (greedy, seeded)]
    assert after == before
    assert "Traceback" not in "".join(err)


def test_fuzz_raw_bytes_on_the_socket(server):
    """Junk and half-HTTP on the socket: an HTTP 4xx at once (or, for what could still become a request,
    nothing yet), never a 5xx or a traceback; the server answers normally afterwards."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    base, err, _ = server
    host, port = base.rsplit("/", 1)[1].split(":")
    line = st.sampled_from([b"GET / HTTP/1.1", b"POST /v1/completions HTTP/1.1", b"BREW /pot HTTP/1.1", b"GET",
                            b"POST /generate HTTP/9.9", b"\x16\x03\x01\x02\x00"])  # the last: a TLS hello
    header = st.sampled_from([b"Host: x", b"Content-Length: 5", b"Content-Length: -3", b"Content-Length: 99999999999",
                              b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip", b"X: " + b"a" * 9000,
                              b"Expect: 100-continue", b"Authorization: Bearer " + KEY.encode(), b": empty name"])
    request = st.builds(lambda first, hs, body: first + b"\r\n" + b"\r\n".join(hs) + b"\r\n\r\n" + body,
                        line, st.lists(header, max_size=4), st.binary(max_size=40))

    seen = []

    @settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(request | st.binary(max_size=200))
    def one(data):
        got = b""
        # 3 s: a busy machine may answer a second late (only what is still incomplete waits them out)
        with socket.create_connection((host, int(port)), timeout=3) as c:
            c.sendall(data)
            try:
                while chunk := c.recv(65536):
                    got += chunk
            except socket.timeout:  # a request still incomplete (or kept alive): the server waits for more
                pass
        status = got.split(b" ", 2)[1] if got.startswith(b"HTTP/1.") else b""
        assert got == b"" or status[:1] in (b"1", b"2", b"4"), (data, got[:300])
        seen.append(status[:1])

    one()
    assert seen.count(b"4") >= 20, seen  # most junk is answered, not just dropped
    assert call(base, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 2})[0] == 200
    log = "".join(err)
    assert "Traceback" not in log and "Unhandled" not in log and "Error handling" not in log, log[-3000:]


def test_no_speculate_given_wins_over_the_files_speculation_gamma(tmp_path):
    """The TP server prober's: `--no-speculate` with a file holding speculationGamma 3 was refused as
    "-k 3 ... does not apply with --no-speculate", a -k the user never typed (a flag given wins)."""
    from mindspec.cli import parse
    from mindspec.errors import MindspecError
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"mindspec": {"speculationGamma": 3}}))
    assert parse(["serve", "--config", str(path), "--no-speculate"]).k == "auto"
    with pytest.raises(MindspecError, match="-k 3 sets the draft tokens of a step: it does not apply"):
        parse(["serve", "--config", str(path), "--no-speculate", "-k", "3"])


def test_a_config_that_is_not_a_regular_small_file_is_one_line(tmp_path):
    """The TP server prober's: `--config` on a FIFO waited for a writer, deaf to Ctrl-C and SIGTERM (the
    signals wait while the command line is read), and on /dev/zero it read until the kernel killed it."""
    fifo, big = tmp_path / "fifo.json", tmp_path / "big.json"
    os.mkfifo(fifo)
    big.write_text(" " * (1 << 20) + "{}")
    for path, line in ((fifo, f"{fifo}: not a regular file"), ("/dev/zero", "/dev/zero: not a regular file"),
                       (big, f"{big}: 1048578 bytes; a config.json is at most 1 MiB")):
        p = subprocess.run([sys.executable, "-m", "mindspec", "serve", "--config", str(path)], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and p.stderr == f"mindspec: error: {line}\n", p.stderr
    big.write_text("{}" + " " * ((1 << 20) - 2))  # 1 MiB exactly: read
    from mindspec.cli import parse
    assert os.path.getsize(big) == 1 << 20 and parse(["serve", "--config", str(big)]).port == 1025


def test_time_per_output_token_is_the_time_after_the_first_over_the_tokens_after_it():
    """Found by mutation testing: nothing checked its divisor (n, not n - 1, would read low)."""
    from types import SimpleNamespace
    from mindspec.metrics import Metrics
    m = Metrics()
    stats = dict(drafted=4, accepted=2, target_calls=2, accepted_at=[1, 1], k_used={"2": 2}, acceptance_rate=0.5,
                 tokens_per_target_call=1.5)
    m.finish(5, SimpleNamespace(finish_reason="length", token_ids=[7, 8, 9], stats=stats), 1.0, 3.0)
    assert m.registry.get_sample_value("mindspec_time_per_output_token_seconds_sum") == 1.0  # (3 - 1) / 2
    assert m.registry.get_sample_value("mindspec_time_to_first_token_seconds_sum") == 1.0
    m.finish(5, SimpleNamespace(finish_reason="stop", token_ids=[7], stats=stats), 0.5, 0.5)  # one token: no tpot
    assert m.registry.get_sample_value("mindspec_time_per_output_token_seconds_count") == 1


def test_an_ipv6_address_is_written_in_brackets_in_the_lines_that_give_the_url():
    """A MindIE prober's: ipAddress "::1" printed "serving ... on http://::1:18445", not a URL."""
    from mindspec.serve import _url
    assert (_url("::1", 18445), _url("127.0.0.1", 1025)) == ("http://[::1]:18445", "http://127.0.0.1:1025")


def test_a_container_address_that_listens_everywhere_is_named_by_its_variable(tmp_path, monkeypatch):
    """The review's: MIES_CONTAINER_IP=0.0.0.0 was refused as "ServerConfig.ipAddress: 0.0.0.0 ...", a value the
    file did not hold."""
    from mindspec.cli import parse
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"ServerConfig": {"ipAddress": "127.0.0.1"}}))
    monkeypatch.setenv("MIES_CONTAINER_IP", "0.0.0.0")
    with pytest.raises(MindspecError, match=r"^\$MIES_CONTAINER_IP: 0.0.0.0 listens on every interface"):
        parse(["serve", "--config", str(path)])


def test_the_precision_and_device_come_from_the_config_unless_a_flag_says(tmp_path):
    """A float16 prober's: a deployment's config could not set the precision (`mindspec.dtype` was an unknown key,
    ignored: the server ran float32)."""
    from mindspec import cli
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"mindspec": {"dtype": "float16", "device": "cpu"}}))
    a = cli.parse(["serve", "--config", str(path)])
    assert (a.dtype, a.device) == ("float16", "cpu")
    assert cli.parse(["serve", "--config", str(path), "--dtype", "float32"]).dtype == "float32"
