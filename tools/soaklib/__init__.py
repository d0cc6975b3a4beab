"""The reliability harness behind ``tools/soak.py``: one module per scenario.

common.py holds what every scenario shares: the workload (a tiny llama, a set
of prompts that share prefixes, live reference logits), the exactness check,
directory measurements, CLI runs and the result record.
"""
