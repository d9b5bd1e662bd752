"""`mindspec serve --config` (MindIE Service's config.json layout + a "mindspec" block) and `--api-key`,
on a real server over real HTTP; then a hypothesis fuzz of every endpoint's body on the same server:
never a 5xx, never a hang, one-line JSON errors, and the same answers afterwards."""
import json
import queue
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from mindspec.export import export_draft

KEY = "sekret"
MAX_SEQ = 128


@pytest.fixture(scope="module")
def config(tiny_target, tiny_draft_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("serveconfig")
    draft = str(d / "draft.onnx")
    export_draft(tiny_draft_ckpt[0], draft)
    cfg = {
        "Version": "1.0.0",
        "LogConfig": {"logLevel": "Info"},
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": 0, "maxLinkNum": 50, "httpsEnabled": False,
                         "managementPort": 1026, "tokenTimeout": 600},
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
    """(base URL, stderr lines) of a server configured by the file; --model-name on the command line wins."""
    p = subprocess.Popen([sys.executable, "-m", "mindspec", "serve", "--config", config, "--model-name", "tiny2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, err = queue.Queue(), []
    threading.Thread(target=lambda: [lines.put(x) for x in p.stdout], daemon=True).start()
    threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()
    try:
        while not (m := re.search(r"serving tiny2 on (http://127\.0\.0\.1:\d+) \(up to 2 requests", lines.get(timeout=300))):
            pass
        yield m.group(1), err
    finally:
        p.terminate()
        p.wait(timeout=60)


def call(base, path, body=None, key=KEY, raw=None, timeout=120):
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base + path, data=data, headers=headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_file_sets_the_flags_and_unknown_keys_are_warned(server):
    base, err = server
    status, text = call(base, "/v1/models")
    assert status == 200 and [(m["id"], m["max_model_len"]) for m in json.loads(text)["data"]] == [("tiny2", MAX_SEQ)]
    c = json.loads(call(base, "/v1/completions", {"prompt": [5, 6, 7, 8]})[1])
    assert c["usage"]["completion_tokens"] == 6 or c["choices"][0]["finish_reason"] == "stop"  # maxIterTimes
    assert c["mindspec"]["k_used"].keys() <= {"0", "1", "2"} and c["mindspec"]["drafted"] > 0  # the draft, K=2
    status, text = call(base, "/v1/completions", {"prompt": [5] * 41})  # maxInputTokenLen
    assert status == 400 and "prompt is 41 tokens, more than this server's limit of 40" in text
    log = "".join(err)
    assert "unknown key mindspec.colour (ignored)" in log and "unknown key Extra (ignored)" in log
    assert "managementPort" not in log and "npuDeviceIds" not in log  # MindIE's own keys: quiet


def test_api_key(server):
    base, _ = server
    for key in (None, "wrong"):
        status, text = call(base, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}, key=key)
        assert status == 401 and "API key" in json.loads(text)["error"]["message"]
        status, text = call(base, "/generate", {"inputs": "hi"}, key=key)
        assert status == 401 and json.loads(text)["error_type"] == "validation"
    assert call(base, "/health", key=None) == (200, "")
    assert call(base, "/v2/health/ready", key=None) == (200, "")
    assert call(base, "/metrics", key=None)[0] == 200
    assert call(base, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})[0] == 200


BAD_CONFIGS = [  # (file content, the one line expected)
    ({"ServerConfig": {"port": "x"}}, 'ServerConfig.port: must be an integer >= 0 and <= 65535, got "x"'),
    ({"ServerConfig": {"httpsEnabled": True}}, "ServerConfig.httpsEnabled: must be false"),
    ({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"worldSize": 0}]}}},
     "BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize: must be an integer >= 1, got 0"),
    ({"BackendConfig": {"ScheduleConfig": {"maxBatchSize": 2.5}}}, "BackendConfig.ScheduleConfig.maxBatchSize: must be"),
    ({"mindspec": {"speculationGamma": "fast"}}, 'mindspec.speculationGamma: must be an integer >= 1 and <= 8, got "fast"'),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object"),
]


@pytest.mark.parametrize("content,line", BAD_CONFIGS)
def test_bad_config_values_are_refused_with_the_key_path(tmp_path, content, line):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    p = subprocess.run([sys.executable, "-m", "mindspec", "serve", "--config", str(path)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and line in p.stderr, p.stderr
    assert p.stderr.startswith("mindspec: error: ")


def test_flags_override_the_file_and_a_missing_file_is_one_line(tmp_path):
    from mindspec.cli import parser
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"ServerConfig": {"port": 2000, "ipAddress": "0.0.0.0"},
                                "BackendConfig": {"ScheduleConfig": {"maxBatchSize": 4}}}))
    a = parser().parse_args(["serve", "--port", "3000", "--config", str(path), "--max-batch", "2"])
    assert (a.port, a.host, a.max_batch) == (3000, "0.0.0.0", 2)
    p = subprocess.run([sys.executable, "-m", "mindspec", "serve", "--config", str(tmp_path / "nope.json")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "No such file" in p.stderr, p.stderr
