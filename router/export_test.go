package router

// WithDialledName is withDialledName, for tests that dial a TLSFiles
// client config with crypto/tls directly, as NodeDialOptions would.
var WithDialledName = withDialledName
