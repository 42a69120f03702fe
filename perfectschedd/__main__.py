from perfectschedd.master.supervisor import main

raise SystemExit(main())
