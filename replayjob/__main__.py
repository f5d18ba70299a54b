from replayjob.cli import console_main

console_main()
