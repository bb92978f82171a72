from zerorun.cli import main

main()
