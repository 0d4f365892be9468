from cni.plugin import main

main()
