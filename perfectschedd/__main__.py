from perfectschedd.master.main import main

raise SystemExit(main())
