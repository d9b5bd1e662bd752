"""`mindspec serve`'s /metrics: Prometheus text format (prometheus_client), one registry per server.

Besides the usual serving figures (requests by endpoint and status, queue depth, running rows,
tokens, time to first token, time per output token, engine health and failed engine steps) it
reports the speculative ones from each finished request's stats: tokens drafted and accepted,
acceptance per draft position, tokens per target call and the K chosen per step."""
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mindspec_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.waiting = Gauge("mindspec_requests_waiting", "requests queued for a row", registry=r)
        self.running = Gauge("mindspec_requests_running", "rows in the engine", registry=r)
        self.healthy = Gauge("mindspec_engine_healthy", "1 while /health answers 200: loaded, the engine has not "
                             "failed serve.FAILED_STEPS steps in a row, and no step has run past --step-timeout",
                             registry=r)
        self.cold_graphs = Gauge("mindspec_graphs_cold", "graphs not yet run: the larger batches' compile after ready, "
                                 "and a graph's first run costs a fraction of a second more; an idle server does "
                                 "both, one graph per idle tick", registry=r)
        self.engine_errors = Counter("mindspec_engine_errors", "engine steps whose target or draft call raised "
                                     "(their requests ended with an error)", registry=r)
        self.finished = Counter("mindspec_requests_finished", "generations ended, by finish reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("mindspec_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.cached_tokens = Counter("mindspec_prompt_tokens_cached", "prompt tokens whose K/V a slot already held "
                                     "(prefix caching: not prefilled again)", registry=r)
        self.generated_tokens = Counter("mindspec_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("mindspec_time_to_first_token_seconds", "from arrival to the first token",
                              buckets=_SECONDS, registry=r)
        self.tpot = Histogram("mindspec_time_per_output_token_seconds", "after the first token, per token",
                              buckets=_SECONDS, registry=r)
        self.drafted = Counter("mindspec_spec_draft_tokens", "draft tokens proposed to the target", registry=r)
        self.accepted = Counter("mindspec_spec_accepted_tokens", "draft tokens the target kept", registry=r)
        self.accepted_at = Counter("mindspec_spec_accepted_at_position", "a finished request's steps whose draft at "
                                   "this position (0 = first) was accepted", ["position"], registry=r)
        self.k_steps = Counter("mindspec_spec_k_steps", "a finished request's steps run with this K (0: no draft); "
                               "a step of B rows counts B", ["k"], registry=r)
        self.target_calls = Counter("mindspec_spec_target_calls", "a finished request's target calls (prefill counts "
                                    "one); a call of B rows counts B", registry=r)
        self.acceptance = Histogram("mindspec_spec_acceptance_rate", "per request: accepted / drafted",
                                    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), registry=r)
        self.per_call = Histogram("mindspec_spec_tokens_per_target_call", "per request: tokens per target call",
                                  buckets=(1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 9.0), registry=r)

    def answered(self, endpoint, status):
        self.requests.labels(endpoint, str(status)).inc()

    def finish(self, prompt_tokens, res, ttft_s, last_s):
        """A generation ended (res: sequence.Result); prompt_tokens: None for a choice after the first of a
        request (they share its prompt); ttft_s/last_s: seconds from arrival to its first token (None when none
        came) and to its end."""
        s, n = res.stats, len(res.token_ids)
        self.finished.labels(res.finish_reason).inc()
        if prompt_tokens is not None:
            self.prompt_tokens.inc(prompt_tokens)
            self.cached_tokens.inc(s.get("cached_tokens", 0))
        self.generated_tokens.inc(n)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if n > 1:
                self.tpot.observe((last_s - ttft_s) / (n - 1))
        self.drafted.inc(s["drafted"])
        self.accepted.inc(s["accepted"])
        self.target_calls.inc(s["target_calls"])
        for i, count in enumerate(s["accepted_at"]):
            self.accepted_at.labels(str(i)).inc(count)
        for k, steps in s["k_used"].items():
            self.k_steps.labels(k).inc(steps)
        if s["acceptance_rate"] is not None:
            self.acceptance.observe(s["acceptance_rate"])
        if n:
            self.per_call.observe(s["tokens_per_target_call"])

    def text(self):
        return generate_latest(self.registry)
