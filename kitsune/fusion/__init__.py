"""The fusion planner and the fused executor: optimizer class + group options + dtype/device -> fused kernel or
fallback, with reasons (`kitsune.fusion.planner`), run every step (`kitsune.fusion.executor`)."""

from kitsune.fusion.executor import FusionSubsystem
from kitsune.fusion.plan import BucketPlan, CostModel, Plan, Route

__all__ = ["BucketPlan", "CostModel", "FusionSubsystem", "Plan", "Route"]
