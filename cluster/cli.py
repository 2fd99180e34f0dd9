def main():
    print("pdcluster")
