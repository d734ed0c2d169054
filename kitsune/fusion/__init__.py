"""The fusion planner: optimizer class + group options + dtype/device -> fused kernel or fallback, with reasons."""

from kitsune.fusion.plan import BucketPlan, CostModel, Plan, Route
from kitsune.fusion.subsystem import FusionSubsystem

__all__ = ["BucketPlan", "CostModel", "FusionSubsystem", "Plan", "Route"]
