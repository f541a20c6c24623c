from ddpkit.cli import main

raise SystemExit(main())
