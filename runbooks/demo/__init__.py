"""`runbook demo`: an engine in trouble, detected, fixed and reverted, live on one machine.

Creates a random-weight tiny Llama, starts vLLM's OpenAI server on the CPU
with the collector plugin (small KV cache, scheduling policy `priority`) and
`runbook serve` on SQLite with its embedded evaluator and automation `auto`
for oom-pressure and latency-spike, then drives five phases of traffic:

  steady       mixed-length requests sharing a system prompt
  long-burst   long prompts that overfill the KV cache: preemptions
               → VllmOOMPressure → oom-pressure halves the budget, caps max_num_seqs
  settle       light traffic while oom-pressure's finding resolves and is reverted
  starvation   low-priority requests stuck behind a stream of high-priority ones
               → VllmRequestStarvation → latency-spike switches the policy to FCFS
  recovery     light traffic; the findings resolve and the service reverts

It prints one line of signals per second and every event of the service as
it happens (from its /api/incidents and /api/executions), then a summary
table and a timeline picture. Exits FAILED when the story did not happen (no
detection, no action, no recovery), USAGE when it could not start. Every process
it starts is stopped on the way out, also on Ctrl-C.

The demo's rule overrides and runbook timings (seconds instead of minutes)
are in the files it writes to the demo directory; see DEMO.md in
this package (package data). It needs the installed package and vLLM, no source checkout.

The package, by job: config (settings, the files it writes), traffic (the
clients), live (the event feed and the per-second monitor), story (the
processes and the phases), summary (the verdict); the server processes are
vllm_runbook.runbooks.demo.servers; its options are vllm_runbook.runbooks.operate.cli.demo.
"""

from __future__ import annotations

DESCRIPTION = __doc__.splitlines()[0].removeprefix("`runbook demo`: ")
