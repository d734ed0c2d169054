from kitsune.bench.cli import main

raise SystemExit(main())
