module forkyard/envd

go 1.26.8

require (
	connectrpc.com/connect v1.21.1
	github.com/creack/pty v1.1.24
	github.com/fsnotify/fsnotify v1.10.1
	golang.org/x/sys v0.50.0
	google.golang.org/protobuf v1.36.12
)
