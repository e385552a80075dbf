// Command coredns is CoreDNS with only the plugins the local cluster's DNS needs: cluster names
// from the API server (kubernetes), health/ready endpoints, caching and logging. No forward
// plugin: pods resolve cluster names only, nothing leaves this machine.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
	_ "github.com/coredns/coredns/plugin/whoami"
)

// Plugin order matters (it is the order queries pass through them): a subset of upstream's
// plugin.cfg, same relative order.
var directives = []string{
	"reload",
	"bind",
	"health",
	"ready",
	"errors",
	"log",
	"cache",
	"loop",
	"kubernetes",
	"whoami",
}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
