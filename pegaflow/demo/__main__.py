from .single_node import main

raise SystemExit(main())
