from titanlite.dryrun.run import main

main()
