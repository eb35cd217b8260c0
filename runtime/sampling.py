"""Former home of SamplingParams and the sampler (now runtime/sampling_params.py and
runtime/sampler.py); SamplingParams stays importable from here until every importer has moved."""

from __future__ import annotations

from forklm.runtime.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
