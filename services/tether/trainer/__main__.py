from tether.trainer.main import main

main()
