"""`mindspec serve --config config.json`: MindIE Service's config.json layout, plus a "mindspec" block.

The file fills in serve's flags; a flag given on the command line wins. Keys MindIE has that
mean nothing here (TLS paths, log settings, scheduler tuning) are accepted quietly; any other key
is warned about; a value of the wrong type or range stops the command with the key's path (one
line, exit 2), before anything loads."""
import json
import os
import stat
import sys

MAX_BYTES = 1 << 20  # a MindIE config.json is a few kB
QUEUE_DELAY_US = 5000  # MindIE's maxQueueDelayMicroseconds default, serve's --max-queue-delay-us (serve.wait_s)


def _int(lo=None, hi=None):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(f"must be an integer{f' >= {lo}' if lo is not None else ''}"
                             f"{f' and <= {hi}' if hi is not None else ''}, got {json.dumps(v)}")
        return v
    return check


def _str(v):
    if not isinstance(v, str) or not v:
        raise ValueError(f"must be a non-empty string, got {json.dumps(v)}")
    return v


def _false(why):
    def check(v):
        if v is not False:
            raise ValueError(f"must be false: {why}, got {json.dumps(v)}")
        return v
    return check


def _gamma(v):
    if v == "auto":
        return v
    try:
        return _int(1, 8)(v)
    except ValueError:  # (the docs prober's: it never said "auto" was one)
        raise ValueError(f"must be \"auto\" or an integer >= 1 and <= 8, got {json.dumps(v)}") from None


def _number(lo, hi):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise ValueError(f"must be a number in [{lo}, {hi}], got {json.dumps(v)}")
        return float(v)
    return check


# MindIE key path -> (serve's flag dest or None: checked, no flag; check: the value to use, or ValueError)
KEYS = {
    "ServerConfig.ipAddress": ("host", _str),
    "ServerConfig.port": ("port", _int(0, 65535)),
    "ServerConfig.maxLinkNum": ("max_connections", _int(1)),
    "ServerConfig.managementIpAddress": ("management_host", _str),
    "ServerConfig.managementPort": ("management_port", _int(0, 65535)),
    "ServerConfig.metricsPort": ("metrics_port", _int(0, 65535)),
    "ServerConfig.httpsEnabled": (None, _false("mindspec serves plain HTTP (put TLS in a proxy)")),
    "BackendConfig.npuDeviceIds": (None, lambda v: v),  # (checked with worldSize: _together, apply)
    "BackendConfig.ModelDeployConfig.maxSeqLen": ("max_seq", _int(2)),
    "BackendConfig.ModelDeployConfig.maxInputTokenLen": ("max_input_tokens", _int(1)),
    "BackendConfig.ModelDeployConfig.truncation": (None, _false("a prompt longer than --max-input-tokens is "
                                                                "refused, never cut")),
    "BackendConfig.ModelDeployConfig.ModelConfig[0].modelName": ("model_name", _str),
    "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath": ("target", _str),
    "BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize": ("tp", _int(1)),
    "BackendConfig.ScheduleConfig.maxBatchSize": ("max_batch", _int(1)),
    "BackendConfig.ScheduleConfig.maxIterTimes": ("max_new_tokens", _int(1)),
    "BackendConfig.ScheduleConfig.maxQueueDelayMicroseconds": ("max_queue_delay_us", _int(0, 1_000_000)),
    "mindspec.draft": ("draft", _str),
    "mindspec.speculationGamma": ("k", _gamma),
    "mindspec.draftTemperature": ("draft_temperature", _number(0.01, 100)),
    "mindspec.maxQueue": ("max_queue", _int(0)),
    "mindspec.readTimeout": ("read_timeout", _int(1)),
    "mindspec.apiKey": ("api_key", _str),
}
# MindIE's keys with no meaning for mindspec: accepted without a warning
QUIET = {"Version", "LogConfig", "EnableDynamicAdjustTimeoutConfig"} | {f"ServerConfig.{k}" for k in (
    "allowAllZeroIpListening", "fullTextEnabled",
    "tlsCaPath", "tlsCaFile", "tlsCert", "tlsPk", "tlsPkPwd", "tlsCrlPath", "tlsCrlFiles", "managementTlsCaFile",
    "managementTlsCert", "managementTlsPk", "managementTlsPkPwd", "managementTlsCrlPath", "managementTlsCrlFiles",
    "kmcKsfMaster", "kmcKsfStandby", "inferMode", "interCommTLSEnabled", "interCommPort", "interCommTlsCaPath",
    "interCommTlsCaFiles", "interCommTlsCert", "interCommPk", "interCommPkPwd", "interCommTlsCrlPath",
    "interCommTlsCrlFiles", "openAiSupport", "tokenTimeout", "e2eTimeout", "distDPServerEnabled",
    "maxRequestLength")} | {
    f"BackendConfig.{k}" for k in (
        "backendName", "modelInstanceNumber", "tokenizerProcessNumber", "multiNodesInferEnabled",
        "multiNodesInferPort", "interNodeTLSEnabled", "interNodeTlsCaPath", "interNodeTlsCaFiles",
        "interNodeTlsCert", "interNodeTlsPk", "interNodeTlsPkPwd", "interNodeTlsCrlPath", "interNodeTlsCrlFiles",
        "interNodeKmcKsfMaster", "interNodeKmcKsfStandby")} | {
    f"BackendConfig.ModelDeployConfig.ModelConfig[0].{k}" for k in (
        "modelInstanceType", "cpuMemSize", "npuMemSize", "backendType", "trustRemoteCode")} | {
    f"BackendConfig.ScheduleConfig.{k}" for k in (
        "templateType", "templateName", "cacheBlockSize", "maxPrefillBatchSize", "maxPrefillTokens",
        "prefillTimeMsPerReq", "prefillPolicyType", "decodeTimeMsPerReq", "decodePolicyType", "maxPreemptCount",
        "supportSelectBatch", "maxFirstTokenWaitTime")}


# the blocks of MindIE's layout (and ours): a block of another shape is refused, not warned about and skipped
MODEL_LIST = "BackendConfig.ModelDeployConfig.ModelConfig"
# MindIE's keys that mean something mindspec does not do: warned about, with why
NOTED = {f"{MODEL_LIST}[0].plugin_params": "MindIE's speculation plugins (MTP, lookahead) are not used; mindspec "
                                          "speculates with its draft (mindspec.draft)"}
OBJECTS = ("ServerConfig", "BackendConfig", "BackendConfig.ModelDeployConfig", "BackendConfig.ScheduleConfig",
           "mindspec")
KINDS = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number",
         type(None): "null"}


def _flatten(obj, path=""):
    """{key path: value} of the leaves (ModelConfig is a list: its entries are [i]); a key of KEYS is a
    leaf whatever its value holds, so its check sees an object there."""
    entry = path.startswith(MODEL_LIST + "[") and path.endswith("]")  # ModelConfig[i]
    shape = list if path == MODEL_LIST else dict if path in OBJECTS or entry else None
    if shape is not None and not isinstance(obj, shape):
        what = "a list of objects" if shape is list else "an object"
        raise ValueError(f"{path}: must be {what} (MindIE's layout), got {KINDS.get(type(obj), 'a value')}")
    if isinstance(obj, dict) and (path in ("", "ServerConfig", "BackendConfig", "mindspec")
                                  or path.startswith("BackendConfig.")) and path not in QUIET and path not in KEYS:
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{path}.{k}" if path else str(k)))
        return out
    if isinstance(obj, list) and path.endswith("ModelConfig"):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{path}[{i}]"))
        return out
    return {path: obj}


def read(path):
    """(values by flag dest, warnings) of a config file; raises ValueError("key.path: why")."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    # a FIFO waited for a writer (deaf to Ctrl-C while the command line is read), /dev/zero never ended
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise ValueError(f"{path}: not a regular file")
    if st.st_size > MAX_BYTES:
        raise ValueError(f"{path}: {st.st_size} bytes; a config.json is at most 1 MiB")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # (RecursionError: nested deeper than Python's stack)
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    try:
        flat = _flatten(data) if isinstance(data, dict) else None  # (ValueError: a block of another shape)
    except RecursionError:  # (Python 3.12's json nests deeper than its Python stack)
        raise ValueError(f"{path}: nested too deeply") from None
    if flat is None:
        raise ValueError(f"{path}: must be a JSON object (MindIE's config.json layout)")
    values, warnings = {}, []
    extra = sorted({int(k[len(MODEL_LIST) + 1:].split("]")[0]) for k in flat if k.startswith(MODEL_LIST + "[")} - {0})
    for i in extra:  # (each of its keys was an "unknown key": they are MindIE's, the model is what is not served)
        name = flat.get(f"{MODEL_LIST}[{i}].modelName")
        warnings.append(f"{path}: {MODEL_LIST}[{i}]{f' ({name})' if isinstance(name, str) else ''} is not served: "
                        f"mindspec serves one model, {MODEL_LIST}[0]")
    for key, value in flat.items():
        if key.startswith(MODEL_LIST + "[") and not key.startswith(MODEL_LIST + "[0]"):
            continue
        if key in NOTED:
            warnings.append(f"{path}: {key} is not used: {NOTED[key]}")
        elif key in KEYS:
            dest, check = KEYS[key]
            try:
                value = check(value)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
            if dest:
                values[dest] = value
        elif key not in QUIET:
            warnings.append(f"{path}: unknown key {key} (ignored)")
    _together(flat, values)
    return values, warnings


def _together(flat, values):
    """MindIE's rules across keys, each of which stops MindIE from starting; npuDeviceIds' first instance
    into values["npu_devices"] (its count is checked against the final --tp in apply)."""
    for key in ("ipAddress", "managementIpAddress"):
        host = flat.get(f"ServerConfig.{key}")
        if host in ("0.0.0.0", "::") and flat.get("ServerConfig.allowAllZeroIpListening") is not True:
            raise ValueError(f"ServerConfig.{key}: {host} listens on every interface, which MindIE allows only "
                             "with ServerConfig.allowAllZeroIpListening true")
    seq, prompt = values.get("max_seq"), values.get("max_input_tokens")
    if seq is not None and prompt is not None and prompt > seq:
        raise ValueError(f"BackendConfig.ModelDeployConfig.maxInputTokenLen: must be <= maxSeqLen ({seq}), "
                         f"got {prompt}")
    ids = flat.get("BackendConfig.npuDeviceIds")
    if ids is not None:
        first = ids[0] if isinstance(ids, list) and ids else None
        if not (isinstance(first, list) and first and all(_is_id(i) for i in first) and len(set(first)) == len(first)):
            raise ValueError(f"BackendConfig.npuDeviceIds: must be a list of lists of distinct device ids (one "
                             f"list a model instance), got {json.dumps(ids)}")
        values["npu_devices"] = first


def _is_id(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def visible_devices(ids, env):
    """ASCEND_RT_VISIBLE_DEVICES for npuDeviceIds `ids`: device ids as CANN numbers them for this process, so
    the ones an ASCEND_RT_VISIBLE_DEVICES already set lists, by position (logical ids), else themselves."""
    seen = [x.strip() for x in env.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",") if x.strip()]
    if seen and max(ids) >= len(seen):
        from .errors import MindspecError
        raise MindspecError(f"BackendConfig.npuDeviceIds: {max(ids)} is not one of the {len(seen)} devices "
                            f"ASCEND_RT_VISIBLE_DEVICES={env['ASCEND_RT_VISIBLE_DEVICES']} leaves visible")
    return ",".join(seen[i] for i in ids) if seen else ",".join(str(i) for i in ids)


def apply(args, path, given):
    """Set every serve flag the file at `path` holds on `args`, except the flags in `given` (the dests the
    command line set itself, before or after --config; a value equal to the default counts as given)."""
    from .errors import MindspecError
    try:
        values, warnings = read(path)
    except ValueError as e:
        raise MindspecError(str(e)) from None
    for w in warnings:
        print(f"mindspec: warning: {w}", file=sys.stderr)
    for dest, value in values.items():
        if dest not in given:
            setattr(args, dest, value)
    devices = values.get("npu_devices")
    if devices is not None:
        if len(devices) != args.tp:  # (MindIE: worldSize devices a model instance)
            raise MindspecError(f"BackendConfig.npuDeviceIds: {len(devices)} devices {devices} for "
                                f"{args.tp} tensor-parallel ranks (worldSize / --tp): give one a rank")
        args.visible_devices = visible_devices(devices, os.environ)  # (set by main, for every rank)
