from commfx.cli.main import main

raise SystemExit(main())
