"""CTranslate2 beside the float64 oracle (docs/deployment.md).

    target   `rosetta convert --to ctranslate2` (CTranslate2's own converter) and `rosetta check`'s
             ctranslate2 section; `python -m conformance.check.ctranslate2.target`
    compare  a CTranslate2 model (ours or the user's) beside the oracle: score_batch log p and
             translate_batch ids
    model    a CTranslate2 directory read: vocabularies (ids <-> tokens), config.json, model.bin's header
    report   the CTranslate2 report: a row per compute type, its verdict, table and JSON

May import what conformance.check may; ctranslate2 lazily.
"""
