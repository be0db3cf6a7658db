"""The core types every pass reads: the spec (:mod:`shardc.ir.spec`), the plan (:mod:`shardc.ir.plan`)
and the typed local operations its steps carry (:mod:`shardc.ir.localops`)."""
