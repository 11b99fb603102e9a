from fermijit.cli import main

main()
