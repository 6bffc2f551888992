// kube-scheduler's side of bench/extender_latency.py, in Go: each pending pod through
// the extender's filter and bind over HTTP, one after another, sent and
// read as kube-scheduler's HTTPExtender does (pkg/scheduler/framework/extender.go):
// encoding/json of ExtenderArgs (fields Pod, Nodes, NodeNames in that order), a POST
// with Content-Type application/json on a kept-alive net/http connection, the answer
// decoded with encoding/json.
//
// Reads one JSON object on stdin: {"base": URL, "names": [...], "pods": [...], "seed": N}
// (the pods as JSON objects, sent as they are, like the Python stand-in). Writes one on
// stdout: {"client_side": {"filter": [seconds...], ...}, "outcomes": {...}}, the same
// shape the Python stand-in returns. A verb's time runs from the request being handed to
// the HTTP client to the answer's last byte read, as the Python stand-in measures it:
// encoding before and decoding after are left out.
//
// Only for the benchmark; it talks to 127.0.0.1 only (the URL it is given).
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand"
	"net/http"
	"os"
	"strings"
	"time"
)

type input struct {
	Base  string            `json:"base"`
	Names []string          `json:"names"`
	Pods  []json.RawMessage `json:"pods"`
	Seed  int64             `json:"seed"`
}

// The types of k8s.io/kube-scheduler/extender/v1, with the pod left as raw JSON.
type extenderArgs struct {
	Pod       json.RawMessage
	Nodes     *json.RawMessage
	NodeNames *[]string
}

type filterResult struct {
	NodeNames                  *[]string
	FailedNodes                map[string]string
	FailedAndUnresolvableNodes map[string]string
	Error                      string
}

type bindingArgs struct {
	PodName      string
	PodNamespace string
	PodUID       string
	Node         string
}

type bindingResult struct {
	Error string
}

type podMeta struct {
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
		UID       string `json:"uid"`
	} `json:"metadata"`
}

type client struct {
	base  string
	http  *http.Client
	times map[string][]float64
}

func (c *client) send(verb string, args interface{}, result interface{}) error {
	out, err := json.Marshal(args)
	if err != nil {
		return err
	}
	url := strings.TrimRight(c.base, "/") + "/" + verb
	began := time.Now()
	req, err := http.NewRequest("POST", url, bytes.NewReader(out))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	c.times[verb] = append(c.times[verb], time.Since(began).Seconds())
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: HTTP %d: %s", verb, resp.StatusCode, body)
	}
	return json.Unmarshal(body, result)
}

func run(in input) (map[string]interface{}, error) {
	rng := rand.New(rand.NewSource(in.Seed))
	c := &client{
		base:  in.Base,
		http:  &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}, Timeout: 30 * time.Second},
		times: map[string][]float64{"filter": {}, "bind": {}, "total": {}},
	}
	outcomes := map[string]int{"bound": 0, "unschedulable": 0, "refused": 0}
	for _, pod := range in.Pods {
		began := time.Now()
		names := in.Names
		var verdict filterResult
		if err := c.send("filter", extenderArgs{Pod: pod, NodeNames: &names}, &verdict); err != nil {
			return nil, err
		}
		if verdict.NodeNames == nil || len(*verdict.NodeNames) == 0 {
			outcomes["unschedulable"]++
			continue
		}
		// As schedulePod with the shipped profile: one node passed is bound without
		// scoring; several (a policy's tie) are scored by kube-scheduler's own plugins
		// (no prioritizeVerb), here one drawn at random.
		top := *verdict.NodeNames
		var meta podMeta
		if err := json.Unmarshal(pod, &meta); err != nil {
			return nil, err
		}
		var bound bindingResult
		args := bindingArgs{meta.Metadata.Name, meta.Metadata.Namespace, meta.Metadata.UID, top[rng.Intn(len(top))]}
		if err := c.send("bind", args, &bound); err != nil {
			return nil, err
		}
		if bound.Error == "" {
			outcomes["bound"]++
		} else {
			outcomes["refused"]++
		}
		c.times["total"] = append(c.times["total"], time.Since(began).Seconds())
	}
	return map[string]interface{}{"client_side": c.times, "outcomes": outcomes}, nil
}

func main() {
	var in input
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		fmt.Fprintln(os.Stderr, "reading the work:", err)
		os.Exit(2)
	}
	out, err := run(in)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
