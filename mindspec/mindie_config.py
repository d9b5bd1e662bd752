"""`mindspec serve --config config.json`: MindIE Service's config.json layout, plus a "mindspec" block.

The file fills in serve's flags; a flag given on the command line wins. Keys MindIE has that
mean nothing here (TLS paths, log settings, scheduler tuning) are accepted quietly; any other key
is warned about; a value of the wrong type or range stops the command with the key's path (one
line, exit 2), before anything loads."""
import json
import os
import stat
import sys

from .device import CHOICES, narrowed, visible_list
from .errors import MindspecError, is_int, shown
from .spec import DTYPES

MAX_BYTES = 1 << 20  # a MindIE config.json is a few kB
QUEUE_DELAY_US = 5000  # MindIE's maxQueueDelayMicroseconds default, serve's --max-queue-delay-us (serve.wait_s)
# serve's --step-timeout: s one engine step may run (graph compiles not counted) before /health answers 503. A step
# stuck in a graph call (a device fault; a tensor-parallel rank that stopped answering, which a collective waits for
# until its own time-out) cannot be ended from Python, so the server says so for an orchestrator to act; a step takes
# well under a second, a first call of a shape may compile for minutes (App.stalled)
STEP_TIMEOUT = 600


def _int(lo=None, hi=None):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(f"must be an integer{f' >= {lo}' if lo is not None else ''}"
                             f"{f' and <= {hi}' if hi is not None else ''}, got {shown(v)}")
        return v
    return check


def _str(v):
    if not isinstance(v, str) or not v:
        raise ValueError(f"must be a non-empty string, got {shown(v)}")
    return v


def _one_of(*names):
    def check(v):
        if v not in names or not isinstance(v, str):
            raise ValueError(f"must be one of {', '.join(names)}, got {shown(v)}")
        return v
    return check


def _false(why, zero=False):
    """A key whose only value here is false (or, with zero, MindIE's 0 for it too)."""
    def check(v):
        if not (v is False or zero and is_int(v) and v == 0):
            raise ValueError(f"must be false{' or 0' if zero else ''}: {why}, got {shown(v)}")
        return False
    return check


def _bool(v):
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {shown(v)}")
    return v


def _device_ids(v):
    """npuDeviceIds: a list of device-id lists, one a model instance; the first one's (one instance served)."""
    first = v[0] if isinstance(v, list) and v else None
    if not (isinstance(first, list) and first and all(is_int(i) and i >= 0 for i in first)
            and len(set(first)) == len(first)):
        raise ValueError(f"must be a list of lists of distinct device ids (one list a model instance), "
                         f"got {shown(v)}")
    return first


def _gamma(v):
    if v == "auto":
        return v
    try:
        return _int(1, 8)(v)
    except ValueError:  # (the docs prober's: it never said "auto" was one)
        raise ValueError(f"must be \"auto\" or an integer >= 1 and <= 8, got {shown(v)}") from None


def _number(lo, hi):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise ValueError(f"must be a number in [{lo}, {hi}], got {shown(v)}")
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
    "ServerConfig.allowAllZeroIpListening": ("allow_all_zero", _bool),
    "BackendConfig.npuDeviceIds": ("npu_devices", _device_ids),  # (the first instance's: one a rank, apply)
    "BackendConfig.ModelDeployConfig.maxSeqLen": ("max_seq", _int(2)),
    "BackendConfig.ModelDeployConfig.maxInputTokenLen": ("max_input_tokens", _int(1)),
    "BackendConfig.ModelDeployConfig.truncation": (None, _false("a prompt longer than --max-input-tokens is "
                                                                "refused, never cut", zero=True)),  # (-1, 1: cut)
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
    "mindspec.stepTimeout": ("step_timeout", _number(0, 1e9)),
    "mindspec.apiKey": ("api_key", _str),
    "mindspec.dtype": ("dtype", _one_of(*DTYPES)),  # (the target's: --dtype)
    "mindspec.device": ("device", _one_of(*CHOICES)),
}
# MindIE's keys with no meaning for mindspec: accepted without a warning
QUIET = {"Version", "LogConfig", "EnableDynamicAdjustTimeoutConfig"} | {f"ServerConfig.{k}" for k in (
    "fullTextEnabled",
    "tlsCaPath", "tlsCaFile", "tlsCert", "tlsPk", "tlsPkPwd", "tlsCrlPath", "tlsCrlFiles", "managementTlsCaFile",
    "managementTlsCert", "managementTlsPk", "managementTlsPkPwd", "managementTlsCrlPath", "managementTlsCrlFiles",
    "kmcKsfMaster", "kmcKsfStandby", "inferMode", "interCommTLSEnabled", "interCommPort", "interCommTlsCaPath",
    "interCommTlsCaFiles", "interCommTlsCert", "interCommPk", "interCommPkPwd", "interCommTlsCrlPath",
    "interCommTlsCrlFiles", "openAiSupport", "tokenTimeout", "e2eTimeout", "distDPServerEnabled",
    "maxRequestLength", "metricsTlsCaFile", "metricsTlsCert", "metricsTlsPk", "metricsTlsPkPwd", "metricsTlsCrlPath",
    "metricsTlsCrlFiles", "npuUsageThreshold", "HealthCheckConfig", "layerwiseDisaggregated",
    "layerwiseDisaggregatedRoleType", "layerwiseDisaggregatedMasterIpAddress", "layerwiseDisaggregatedSlaveIpAddress",
    "layerwiseDisaggregatedDataPort", "layerwiseDisaggregatedCrtlPort",
    "tlsCrl", "managementTlsCrl", "interCommTlsCaFile", "interCommTlsCrl")} | {  # (the last four: older layouts')
    f"BackendConfig.{k}" for k in (
        "backendName", "modelInstanceNumber", "tokenizerProcessNumber", "multiNodesInferEnabled",
        "multiNodesInferPort", "interNodeTLSEnabled", "interNodeTlsCaPath", "interNodeTlsCaFiles",
        "interNodeTlsCert", "interNodeTlsPk", "interNodeTlsPkPwd", "interNodeTlsCrlPath", "interNodeTlsCrlFiles",
        "interNodeKmcKsfMaster", "interNodeKmcKsfStandby", "interNodeTlsCaFile", "interNodeTlsCrl", "kvPoolConfig")} | {
    f"BackendConfig.ModelDeployConfig.ModelConfig[0].{k}" for k in (
        "modelInstanceType", "cpuMemSize", "npuMemSize", "backendType", "trustRemoteCode", "async_scheduler_wait_time",
        "kv_trans_timeout", "kv_link_timeout", "models")} | {
    f"BackendConfig.ScheduleConfig.{k}" for k in (
        "templateType", "templateName", "cacheBlockSize", "maxPrefillBatchSize", "maxPrefillTokens",
        "prefillTimeMsPerReq", "prefillPolicyType", "decodeTimeMsPerReq", "decodePolicyType", "maxPreemptCount",
        "supportSelectBatch", "maxFirstTokenWaitTime", "stageSelectPolicy", "dynamicBatchSizeEnable",
        "enablePrefixCache", "enableSplit", "enablChunkedPrefill", "policyType", "splitType", "splitStartType",
        "splitChunkTokens", "splitStartBatchSize", "prefillExpectedTime", "decodeExpectedTime", "bufferResponseEnabled",
        "distributedEnable", "maxBeamWidth", "layerwiseDisaggregated", "prefillChunkSize", "maxNumPartialPrefills",
        "maxLongPartialPrefills", "longPrefillTokenThreshold")}  # (split-fuse, chunked prefill: mindspec's is always on)


# the blocks of MindIE's layout (and ours): a block of another shape is refused, not warned about and skipped
MODEL_LIST = "BackendConfig.ModelDeployConfig.ModelConfig"
# MindIE's keys that mean something mindspec does not do: warned about, with why
PLUGINS = ("MindIE's speculation plugins (MTP, lookahead) are not used; mindspec speculates with its draft "
           "(mindspec.draft)")
LORA = "LoRA adapters are not supported: the model at modelWeightPath is served as it is"
NOTED = {f"{MODEL_LIST}[0].plugin_params": PLUGINS, f"{MODEL_LIST}[0].pluginParams": PLUGINS,
         "BackendConfig.ModelDeployConfig.speculationGamma": "it sizes MindIE's speculation plugins; mindspec's K is "
                                                             "mindspec.speculationGamma (-k)",
         "BackendConfig.ModelDeployConfig.LoraModules": LORA, "BackendConfig.ModelDeployConfig.maxLoras": LORA,
         "BackendConfig.ModelDeployConfig.maxLoraRank": LORA} | {
    f"{MODEL_LIST}[0].{k}": "worldSize ranks run tensor-parallel (--tp); no other split of them is made (data "
                            "parallel is --dp: whole replicas)" for k in ("tp", "dp", "sp", "cp", "moe_tp", "moe_ep")}
OBJECTS = ("ServerConfig", "BackendConfig", "BackendConfig.ModelDeployConfig", "BackendConfig.ScheduleConfig",
           "mindspec")
KINDS = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number",
         type(None): "null"}


ENV = {"host": "MIES_CONTAINER_IP", "management_host": "MIES_CONTAINER_MANAGEMENT_IP"}  # (over the file's)


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
        with open(path, encoding="utf-8-sig") as f:  # (a byte-order mark skipped, as MindIE's JSON parser does)
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
    return values, warnings


def apply(args, path, given):
    """Set every serve flag the file at `path` holds on `args`, except the flags in `given` (the dests the
    command line set itself, before or after --config; a value equal to the default counts as given)."""
    try:
        values, warnings = read(path)
    except ValueError as e:
        raise MindspecError(str(e)) from None
    for w in warnings:
        print(f"mindspec: warning: {w}", file=sys.stderr)
    for dest, var in ENV.items():
        if os.environ.get(var):  # (MindIE: a container's address wins over the file's)
            values[dest] = os.environ[var]
    for dest, value in values.items():
        if dest not in given:
            setattr(args, dest, value)
    _together(args, {dest for dest in values if dest not in given}, values.get("allow_all_zero", False))


def _together(args, from_file, zero_ok):
    """MindIE's rules across keys, each of which stops MindIE from starting, on the values the file (or MindIE's
    address variables) set: a flag given on the command line wins, and is the user's own."""
    for dest, key in (("host", "ipAddress"), ("management_host", "managementIpAddress")):
        if dest in from_file and getattr(args, dest) in ("0.0.0.0", "::") and not zero_ok:
            who = f"${ENV[dest]}" if os.environ.get(ENV[dest]) else f"ServerConfig.{key}"  # (what set it)
            raise MindspecError(f"{who}: {getattr(args, dest)} listens on every interface, which "
                                "MindIE allows only with ServerConfig.allowAllZeroIpListening true")
    if getattr(args, "management_host", None) not in (None, args.host):  # (a port serves one address here)
        for key in ("managementPort", "metricsPort"):
            port = getattr(args, "management_port" if key == "managementPort" else "metrics_port", None)
            if (port is None and key == "managementPort") or port == args.port != 0:
                raise MindspecError(f"ServerConfig.managementIpAddress {args.management_host} differs from the "
                                    f"main address {args.host}: give ServerConfig.{key} a port other than the "
                                    f"main port {args.port}")
    devices = getattr(args, "npu_devices", None)
    if devices is not None:
        if len(devices) != args.tp:  # (MindIE: worldSize devices a model instance)
            raise MindspecError(f"BackendConfig.npuDeviceIds: {len(devices)} devices {devices} for "
                                f"{args.tp} tensor-parallel ranks (worldSize / --tp): give one a rank")
        from .tp import is_worker
        if not is_worker():  # (a rank inherits what its launcher set: counted again, they would be wrong)
            args.device_env = narrowed(_named(devices, os.environ), args.tp)  # set by main


def _named(ids, env):
    """npuDeviceIds as the system names the devices: logical ids, counted among an ASCEND_RT_VISIBLE_DEVICES
    already set, else themselves."""
    seen = visible_list(env)
    if seen is not None and max(ids) >= len(seen):
        raise MindspecError(f"BackendConfig.npuDeviceIds: {max(ids)} is not one of the {len(seen)} devices "
                            f"ASCEND_RT_VISIBLE_DEVICES={env['ASCEND_RT_VISIBLE_DEVICES']} leaves visible")
    return [str(i) for i in ids] if seen is None else [seen[i] for i in ids]
