"""`python -m rlkube.runtime.platform --dockerfile-env`: print Dockerfile.rocm's generated ENV block."""

from rlkube.runtime.platform.env import main

raise SystemExit(main())
