from .supervisor import main

raise SystemExit(main())
