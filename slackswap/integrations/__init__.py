"""The plan inside trainers people already use (imports torch; behind the `torch` extra).

`slackswap.integrations.hf.plan_for(trainer, budget=0.5)`: the Hugging Face `Trainer`
(docs/integrations.md). `slackswap.integrations.planning` is the trainer-independent part: capture a
step called with keyword arguments, plan it under a budget, predict and then verify its peak. Nothing
here is imported by the core; import the submodule you use.
"""
