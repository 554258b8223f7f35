"""Runnable reproductions and the demo."""

from .demo import DemoConfig, DemoResult, run_demo

__all__ = ["DemoConfig", "DemoResult", "run_demo"]
