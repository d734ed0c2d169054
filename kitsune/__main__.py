from kitsune.cli import main

raise SystemExit(main())
