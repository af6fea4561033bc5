import sys

try:
    from partitioner_cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the libraries load
    print("partitioner: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
