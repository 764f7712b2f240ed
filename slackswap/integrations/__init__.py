"""The plan inside trainers people already use (imports torch; behind the `torch` extra).

`slackswap.integrations.hf.plan_for(trainer, budget=0.5)`: the Hugging Face `Trainer`;
`slackswap.integrations.accelerate.plan_for(accelerator, model, budget=0.5)`: a hand-written
Accelerate loop; `SlackSwapCallback` of `slackswap.integrations.lightning`: Lightning;
`slackswap.integrations.torchtitan.torchtitan_settings(plan, graph).toml()`: torchtitan's settings
(docs/integrations.md). The trainer-independent parts: `slackswap.integrations.step` (one planned
step per micro-batch) and `slackswap.integrations.planning` (capture a step called with keyword
arguments, plan it under a budget, predict and then verify its peak). Nothing here is imported by the
core; import the submodule you use.
"""
