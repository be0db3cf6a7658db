from __future__ import annotations

from shardc.cli.main import main

raise SystemExit(main())
