"""kvxfer as an SGLang disaggregation transfer backend (``--disaggregation-transfer-backend kvxfer``).

Installed with kvxfer: its ``sglang.srt.plugins`` entry point (``kvxfer_sglang.plugin:register``)
adds the backend to SGLang at start-up. ``layout`` and ``settings`` are pure (tested without
SGLang); ``conn`` holds the classes SGLang instantiates. docs/engines.md has the user's guide.
"""
