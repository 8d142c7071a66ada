from tether.scheduler.main import main

main()
