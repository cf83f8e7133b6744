// Package pb holds the generated protobuf and gRPC code of quotaring's
// internal RPC (quota.proto). The generated files are committed; regenerate
// them after changing quota.proto with
//
//	go generate ./router/pb
//
// which needs protoc (Debian: protobuf-compiler) and the plugins:
//
//	go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
//	go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
package pb

//go:generate protoc --go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative quota.proto
